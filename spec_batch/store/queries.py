"""Queries and conditional updates of the store. Every function takes a Session the caller owns
(``with session_factory.begin() as session: ...``); none commits.

The updates that several processes may race on (claiming, storing a result, finalizing a job) are single
conditional UPDATE statements, so at most one of the racers changes a row: nothing is stored twice and a job
is completed exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, insert, select, update
from sqlalchemy.orm import Session

from ..errors import SpecBatchError
from .models import (
    JOB_VALIDATING,
    REQ_CANCELLED,
    REQ_COMPLETED,
    REQ_FAILED,
    REQ_PENDING,
    REQ_RUNNING,
    REQUEST_OPEN,
    REQUEST_STATUSES,
    Job,
    Request,
    utcnow,
)
from .request_queries import (  # reading request rows: the store's query names
    RequestInput,
    failed_requests,
    iter_requests,
    open_request_ids,
    request_attempts,
    request_ids,
    request_inputs,
    valid_request_ids,
)


class JobNotFoundError(SpecBatchError, LookupError):
    """No job (or more than one) matches the id or prefix given."""


# ---------------------------------------------------------------- jobs

INSERT_BATCH = 1000  # request rows per INSERT statement


def insert_job(session: Session, **values: Any) -> None:
    """Adds a job row (`values`: Job columns by attribute name, the status excepted) in the first status of the
    lifecycle, validating: spec_batch.jobs.lifecycle changes it from there."""
    session.add(Job(status=JOB_VALIDATING, **values))
    session.flush()


def insert_requests(session: Session, rows: Sequence[dict[str, Any]]) -> None:
    """Adds request rows (dicts of Request columns), in batches of INSERT_BATCH."""
    for i in range(0, len(rows), INSERT_BATCH):
        session.execute(insert(Request), list(rows[i : i + INSERT_BATCH]))


def set_job_sizes(session: Session, job_id: str, *, n_requests: int, n_invalid: int) -> None:
    """A job stored before its file was validated (a batch of the API) gets its line counts once it is."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(n_requests=n_requests, n_invalid=n_invalid)
        .execution_options(synchronize_session=False)
    )


def find_job(session: Session, job_id: str) -> Job | None:
    return session.get(Job, job_id)


def get_job(session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise JobNotFoundError(f"no job {job_id!r}: `spec-batch jobs` lists the jobs of this database")
    return job


def resolve_job_id(session: Session, ref: str) -> str:
    """An exact job id, a unique prefix of one, or "latest" (the newest job)."""
    if ref == "latest":
        job_id = session.scalar(select(Job.id).order_by(Job.created_at.desc(), Job.id.desc()).limit(1))
        if job_id is None:
            raise JobNotFoundError("no jobs in this database yet")
        return job_id
    if session.get(Job, ref) is not None:
        return ref
    escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    matches = session.scalars(select(Job.id).where(Job.id.like(escaped + "%", escape="\\")).limit(3)).all()
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise JobNotFoundError(f"no job {ref!r}: `spec-batch jobs` lists the jobs of this database")
    raise JobNotFoundError(f"{ref!r} matches several jobs ({', '.join(matches)}, ...): give more of the id")


def change_job_status(
    session: Session,
    job_id: str,
    *,
    sources: Iterable[str],
    target: str,
    values: dict[str, Any] | None = None,
    unless_open_requests: bool = False,
    unless_running_requests: bool = False,
) -> bool:
    """One conditional UPDATE: the job goes to `target` (with `values`) only from one of `sources`, and, when asked,
    only while none of its requests is open (pending or running) / running. True for the one caller that changed it.

    The states and which changes are allowed live in spec_batch.jobs.lifecycle, the only caller."""
    cond = [Job.id == job_id, Job.status.in_(tuple(sources))]
    if unless_open_requests:
        cond.append(~exists().where(Request.job_id == job_id, Request.status.in_(REQUEST_OPEN)))
    if unless_running_requests:
        cond.append(~exists().where(Request.job_id == job_id, Request.status == REQ_RUNNING))
    res = session.execute(
        update(Job).where(*cond).values(status=target, **(values or {})).execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


def cancel_pending_requests(
    session: Session,
    job_id: str,
    *,
    job_status: str,
    now: datetime | None = None,
    code: str = "batch_cancelled",
    message: str = "the job was cancelled",
) -> int:
    """The job's pending requests -> cancelled, only while the job's status is `job_status` (cancelling, or
    expired with code batch_expired)."""
    return session.execute(
        update(Request)
        .where(
            Request.job_id == job_id,
            Request.status == REQ_PENDING,
            exists().where(Job.id == job_id, Job.status == job_status),
        )
        .values(
            status=REQ_CANCELLED,
            error_code=code,
            error=message,
            completed_at=now or utcnow(),
        )
        .execution_options(synchronize_session=False)
    ).rowcount


def add_decode_time(session: Session, job_id: str, seconds: float) -> None:
    """jobs.decode_wall_s += seconds (atomic in SQL, so concurrent workers add up)."""
    if seconds > 0:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(decode_wall_s=Job.decode_wall_s + float(seconds))
            .execution_options(synchronize_session=False)
        )


def record_baseline(
    session: Session,
    job_id: str,
    *,
    n_requests: int,
    baseline_output_tokens: int,
    baseline_wall_s: float,
    sample_output_tokens: int,
    sample_wall_s: float,
    speedup_low: float | None = None,
    speedup_high: float | None = None,
) -> bool:
    """Stores the job's measured baseline once (the first measurement wins), with the lowest and highest ratio
    of its interleaved rounds."""
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.baseline_wall_s.is_(None))
        .values(
            baseline_requests=n_requests,
            baseline_output_tokens=baseline_output_tokens,
            baseline_wall_s=baseline_wall_s,
            sample_output_tokens=sample_output_tokens,
            sample_wall_s=sample_wall_s,
            speedup_low=speedup_low,
            speedup_high=speedup_high,
        )
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


# ---------------------------------------------------------------- requests


def result_status(result: Any) -> str:
    """The request status a GenerationResult is stored with: failed for finish_reason "error", else completed."""
    return REQ_FAILED if result.finish_reason == "error" else REQ_COMPLETED


def save_result(
    session: Session,
    request_id: int,
    result: Any,
    *,
    worker: str | None = None,
    now: datetime | None = None,
    choices: list[dict[str, Any]] | None = None,
) -> bool:
    """Stores a GenerationResult if the request is still open. True when stored (False: already done).

    finish_reason "error" -> status failed, error = result.error, error_code and error_param the result's (a grammar
    the engine gave up on: grammar_failed, response_format; an internal error: internal_error; else decode_error).
    choices: the output
    choices when `output` is not enough (n > 1, logprobs: spec_batch.jobs.choices), else None.
    """
    status = result_status(result)
    failed = status == REQ_FAILED
    stats = result.stats
    values: dict[str, Any] = {
        "status": status,
        "output": None if failed else result.text,
        "finish_reason": result.finish_reason,
        "error_code": (getattr(result, "error_code", None) or "decode_error") if failed else None,
        "error_param": getattr(result, "error_param", None) if failed else None,
        "error": (result.error or "decoding failed") if failed else None,
        "prompt_tokens": stats.prompt_tokens,
        "output_tokens": stats.output_tokens,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "target_forwards": stats.target_forwards,
        "draft_forwards": stats.draft_forwards,
        "accepted_length_histogram": list(stats.accepted_length_histogram),
        "drafted_per_position": list(stats.drafted_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
        "forced_tokens": stats.forced_tokens,
        "wall_s": stats.wall_s,
        "choices": None if failed else choices,
    }
    return _finish(session, request_id, values, worker=worker, now=now)


def save_failure(
    session: Session,
    request_id: int,
    code: str,
    message: str,
    *,
    worker: str | None = None,
    now: datetime | None = None,
) -> bool:
    """Marks an open request failed without a result (e.g. its chat template failed)."""
    values = {"status": REQ_FAILED, "finish_reason": "error", "error_code": code, "error": message}
    return _finish(session, request_id, values, worker=worker, now=now)


def _finish(session: Session, request_id: int, values: dict, *, worker: str | None, now: datetime | None) -> bool:
    now = now or utcnow()
    values = dict(values)
    values.update(
        completed_at=now,
        lease_expires_at=None,
        started_at=func.coalesce(Request.started_at, now),
    )
    if worker is not None:
        values["worker"] = worker
    res = session.execute(
        update(Request)
        .where(Request.id == request_id, Request.status.in_(REQUEST_OPEN))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


def recent_outputs(session: Session, job_id: str, max_tokens: int) -> list[str]:
    """The job's completed outputs, most recent first, until their output tokens reach max_tokens (the output
    that crosses it included): what warms a worker's job memory for the suffix drafter."""
    stmt = (
        select(Request.output, Request.output_tokens)
        .where(Request.job_id == job_id, Request.status == REQ_COMPLETED, Request.output.is_not(None))
        .order_by(Request.completed_at.desc(), Request.id.desc())
        .execution_options(yield_per=256)
    )
    outputs: list[str] = []
    total = 0
    for text, n in session.execute(stmt):
        if total >= max_tokens:
            break
        outputs.append(text)
        total += n or 0
    return outputs


def job_counts(session: Session, job_id: str) -> dict[str, int]:
    """{status: count} over the job's requests, every status present (0 when none)."""
    rows = session.execute(
        select(Request.status, func.count()).where(Request.job_id == job_id).group_by(Request.status)
    ).all()
    counts = {s: 0 for s in REQUEST_STATUSES}
    counts.update({status: n for status, n in rows})
    return counts


__all__ = [
    "JobNotFoundError",
    "RequestInput",
    "add_decode_time",
    "cancel_pending_requests",
    "change_job_status",
    "failed_requests",
    "find_job",
    "get_job",
    "insert_job",
    "insert_requests",
    "iter_requests",
    "job_counts",
    "open_request_ids",
    "record_baseline",
    "request_attempts",
    "request_ids",
    "request_inputs",
    "resolve_job_id",
    "save_failure",
    "save_result",
    "set_job_sizes",
    "valid_request_ids",
]
