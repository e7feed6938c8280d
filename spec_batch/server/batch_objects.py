"""OpenAI's objects of the Files and Batches API, built from the store's rows: FileObject, Batch (with the
`speculative` extension), and the output and error files of a batch, which are not stored but rendered from the
job's rows on download (jobs.export.result_lines: every line exactly what `spec-batch run` writes).

A batch's result files have ids derived from the batch (``file-<batch id>-output`` / ``-errors``), so they need no
row of their own and always show the job's rows as they are now.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.jobs.export import ERROR, OUTPUT, result_lines
from spec_batch.store import queries, servers, summaries
from spec_batch.store.file_tables import Batch, StoredFile
from spec_batch.store.models import (
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    JOB_TERMINAL,
    REQ_CANCELLED,
    REQ_COMPLETED,
    REQ_FAILED,
    Job,
    utcnow,
)

# The completion windows a batch may ask for (OpenAI's one) and their lengths: a batch not finished within its
# window ends expired (server/housekeeping.py).
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
OUTPUT_SUFFIX, ERRORS_SUFFIX = "-output", "-errors"
PURPOSE_BATCH_OUTPUT = "batch_output"
_KIND_OF_SUFFIX = {OUTPUT_SUFFIX: OUTPUT, ERRORS_SUFFIX: ERROR}
_SUMMARY_FIELDS = (
    "output_tokens",
    "acceptance_rate",
    "tokens_per_step",
    "tokens_per_s",
    "baseline_tokens_per_s",
    "speedup",
    "speedup_low",
    "speedup_high",
    "speedup_reliable",
    "forced_tokens",
)
_STREAM_PIECE = 1 << 16  # bytes of lines sent together in a download


def ts(when: datetime | None) -> int | None:
    return int(when.timestamp()) if when is not None else None


def file_object(row: StoredFile) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": ts(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": row.status,
        "expires_at": None,
        "status_details": None,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


# ---------------------------------------------------------------- result files of a batch


def result_file_id(batch_id: str, kind: str) -> str:
    return f"file-{batch_id}{OUTPUT_SUFFIX if kind == OUTPUT else ERRORS_SUFFIX}"


def parse_result_file_id(file_id: str) -> tuple[str, str] | None:
    """(batch id, OUTPUT | ERROR) of a batch's result file id; None for any other id."""
    for suffix, kind in _KIND_OF_SUFFIX.items():
        if file_id.startswith("file-batch_") and file_id.endswith(suffix):
            return file_id[len("file-") : -len(suffix)], kind
    return None


def iter_result_bytes(session_factory: sessionmaker[Session], batch_id: str, kind: str) -> Iterator[bytes]:
    """The batch's output (OUTPUT) or error (ERROR) file, streamed from its rows in pieces of ~64 KB."""
    piece: list[bytes] = []
    size = 0
    with session_factory() as s:
        for k, text in result_lines(s, batch_id):
            if k != kind:
                continue
            data = text.encode("utf-8")
            piece.append(data)
            size += len(data)
            if size >= _STREAM_PIECE:
                yield b"".join(piece)
                piece, size = [], 0
    if piece:
        yield b"".join(piece)


def result_created_at(job: Job) -> datetime:
    """A result file's created_at: when its job ended."""
    return job.completed_at or job.expired_at or job.cancelled_at or job.failed_at or job.created_at


def result_file_object(session_factory: sessionmaker[Session], batch: Batch, job: Job, kind: str) -> dict[str, Any]:
    size = sum(len(p) for p in iter_result_bytes(session_factory, batch.id, kind))
    suffix = OUTPUT_SUFFIX if kind == OUTPUT else ERRORS_SUFFIX
    return {
        "id": result_file_id(batch.id, kind),
        "object": "file",
        "bytes": size,
        "created_at": ts(result_created_at(job)),
        "filename": f"{batch.id}{suffix}.jsonl",
        "purpose": PURPOSE_BATCH_OUTPUT,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def result_files(job: Job, counts: dict[str, int], batch: Batch | None = None) -> tuple[str | None, str | None]:
    """(output_file_id, error_file_id) of a finished job: each only when it has a line and (for a batch) was not
    deleted through the Files API."""
    if job.status not in JOB_TERMINAL:
        return None, None
    out = result_file_id(job.id, OUTPUT) if counts[REQ_COMPLETED] else None
    err = result_file_id(job.id, ERROR) if counts[REQ_FAILED] + counts[REQ_CANCELLED] else None
    if batch is not None:
        out = None if batch.output_deleted_at is not None else out
        err = None if batch.errors_deleted_at is not None else err
    return out, err


# ---------------------------------------------------------------- the batch object


def speculative(session: Session, job: Job) -> dict[str, Any] | None:
    """The job's acceptance statistics and measured speedup (the job_summary view), with the drafter."""
    row = summaries.job_summary_row(session, job.id)
    if row is None:
        return None
    return {
        "target": job.target,
        "drafter": job.drafter,
        **{k: row.get(k) for k in _SUMMARY_FIELDS},
        "report_url": f"/v1/batches/{job.id}/report",
    }


def expires_at(batch: Batch) -> datetime | None:
    window = COMPLETION_WINDOWS.get(batch.completion_window)
    return batch.created_at + window if window is not None and batch.created_at is not None else None


def usage(session: Session, job: Job) -> dict[str, Any]:
    """OpenAI's batch usage: the tokens of the requests decoded so far (prompts once per prompt, every choice's
    output), as the output lines' usage counts them; the details are OpenAI's (nothing is cached or reasoned)."""
    prompt_tokens, output_tokens = summaries.job_token_totals(session, job.id)
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def no_server_error(session: Session, job: Job) -> dict[str, Any] | None:
    """An entry of `errors` while a batch waits and nothing running can run it (store/servers.py): a local batch
    no live server runs the kind of, a queued batch no live worker consumes the queue of."""
    if job.status not in (JOB_IN_PROGRESS, JOB_FINALIZING):
        return None
    now = utcnow()
    kind = (
        f"target {job.target!r}, drafter {job.drafter!r}, weights {job.weights or 'full'}, dtype {job.dtype or 'any'}"
    )
    if job.queue is not None:
        if servers.queue_served(session, job.queue, now):
            return None
        code = "no_matching_worker"
        message = (
            f"no running worker consumes queue {job.queue!r} ({kind}): the batch waits until one starts "
            f"(spec-batch worker -Q {job.queue})"
        )
    else:
        if servers.can_run(session, job, now):
            return None
        code = "no_matching_server"
        message = f"no running server runs batches for {kind}: the batch waits until one starts"
    return {"code": code, "message": message, "param": None, "line": None}


def batch_object(session: Session, batch: Batch, job: Job, model: str | None = None) -> dict[str, Any]:
    """OpenAI's Batch, mapped from the job (its statuses are OpenAI's), plus `speculative`. While nothing running
    can run the batch, `errors` says so (code no_matching_server, or no_matching_worker for a queued batch) and the
    batch waits."""
    counts = queries.job_counts(session, job.id)
    output_file_id, error_file_id = result_files(job, counts, batch)
    waiting = no_server_error(session, job)
    data = (batch.errors or []) + ([waiting] if waiting else [])
    errors = {"object": "list", "data": data} if data else None
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": job.status,
        "output_file_id": output_file_id,
        "error_file_id": error_file_id,
        "created_at": ts(batch.created_at),
        "in_progress_at": ts(job.started_at),
        "expires_at": ts(expires_at(batch)),
        "finalizing_at": ts(job.finalizing_at),
        "completed_at": ts(job.completed_at),
        "failed_at": ts(job.failed_at),
        "expired_at": ts(job.expired_at),
        "cancelling_at": ts(batch.cancelling_at),
        "cancelled_at": ts(job.cancelled_at),
        "request_counts": {
            "total": job.n_requests,
            "completed": counts[REQ_COMPLETED],
            "failed": counts[REQ_FAILED] + counts[REQ_CANCELLED],
        },
        "metadata": job.user_metadata or None,
        "model": model,
        "usage": usage(session, job),
        "speculative": speculative(session, job),
    }
