"""The job lifecycle: every status a job can have, which changes are allowed, and the one function per change.

The statuses are OpenAI's Batch API's (docs/architecture.md has the diagram)::

    validating -> in_progress -> finalizing -> completed
         |             |             |
         +-------------+-------------+--> failed          (the job as a whole: no valid line, ...)
         |             |
         +-------------+--> cancelling -> cancelled       (once none of its requests runs)

The service, the runner, the Celery task and the reaper change a job's status only through the functions
below; none sets a status itself. Each change is one conditional UPDATE whose allowed source statuses come from
TRANSITIONS, so processes racing on a job change it once (the one that did gets True).

Resuming is not a status: `resume_action` says what continuing a job means in each status.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..errors import SpecBatchError
from ..store import queries
from ..store.models import (
    JOB_CANCELLED,
    JOB_CANCELLING,
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    JOB_STATUSES,
    JOB_TERMINAL,
    JOB_VALIDATING,
    utcnow,
)
from .export import write_results

INITIAL = JOB_VALIDATING  # a job row is inserted with this status, then leaves it by `start` or `fail`

# status -> the statuses it may change to
TRANSITIONS: dict[str, frozenset[str]] = {
    JOB_VALIDATING: frozenset({JOB_IN_PROGRESS, JOB_FAILED, JOB_CANCELLING}),
    JOB_IN_PROGRESS: frozenset({JOB_FINALIZING, JOB_FAILED, JOB_CANCELLING}),
    JOB_FINALIZING: frozenset({JOB_COMPLETED, JOB_FAILED}),
    JOB_CANCELLING: frozenset({JOB_CANCELLED}),
    JOB_COMPLETED: frozenset(),
    JOB_FAILED: frozenset(),
    JOB_CANCELLED: frozenset(),
}

# the timestamp column set when a job enters a status
ENTERED_AT = {
    JOB_IN_PROGRESS: "started_at",
    JOB_FINALIZING: "finalizing_at",
    JOB_COMPLETED: "completed_at",
    JOB_FAILED: "failed_at",
    JOB_CANCELLED: "cancelled_at",
}

# What continuing a job does, by status (resume_action).
RESUME_RUN = "run"  # decode its open requests (local), or hand them back to the workers (queue)
RESUME_FINISH_FINALIZING = "finish_finalizing"  # a process died while finalizing: write the output, complete
RESUME_REWRITE_OUTPUT = "rewrite_output"  # completed: only a missing output file is written again


class JobStateError(SpecBatchError):
    """A job cannot do what was asked in its current status."""


def can_change(source: str, target: str) -> bool:
    return target in TRANSITIONS.get(source, frozenset())


def sources_of(target: str) -> tuple[str, ...]:
    """The statuses from which a job may change to `target`, in JOB_STATUSES order."""
    return tuple(s for s in JOB_STATUSES if target in TRANSITIONS[s])


def is_terminal(status: str) -> bool:
    return not TRANSITIONS[status]


assert set(TRANSITIONS) == set(JOB_STATUSES) and {s for s in JOB_STATUSES if is_terminal(s)} == set(JOB_TERMINAL)


def _change(
    session: Session,
    job_id: str,
    target: str,
    *,
    now: datetime | None = None,
    values: dict[str, Any] | None = None,
    **conditions: bool,
) -> bool:
    stamped = {ENTERED_AT[target]: now or utcnow()} if target in ENTERED_AT else {}
    return queries.change_job_status(
        session, job_id, sources=sources_of(target), target=target, values={**stamped, **(values or {})}, **conditions
    )


# ---------------------------------------------------------------- the changes (one conditional UPDATE each)


def start(session: Session, job_id: str, *, now: datetime | None = None) -> bool:
    """validating -> in_progress: the file is stored (local run) or the job is on the queue."""
    return _change(session, job_id, JOB_IN_PROGRESS, now=now)


def fail(session: Session, job_id: str, error: str, *, now: datetime | None = None) -> bool:
    """validating / in_progress / finalizing -> failed: the job as a whole failed (e.g. no valid line)."""
    return _change(session, job_id, JOB_FAILED, now=now, values={"error": error})


def begin_finalizing(session: Session, job_id: str, *, now: datetime | None = None) -> bool:
    """in_progress -> finalizing, only once none of its requests is open. True for the one winner."""
    return _change(session, job_id, JOB_FINALIZING, now=now, unless_open_requests=True)


def complete(session: Session, job_id: str, *, now: datetime | None = None, error: str | None = None) -> bool:
    """finalizing -> completed. `error` records a problem of finalization (e.g. the output file)."""
    return _change(session, job_id, JOB_COMPLETED, now=now, values={"error": error} if error is not None else None)


def request_cancel(session: Session, job_id: str) -> bool:
    """validating / in_progress -> cancelling. Runners stop at their next decoding step; see settle_cancel."""
    return _change(session, job_id, JOB_CANCELLING)


def settle_cancel(session: Session, job_id: str, *, now: datetime | None = None) -> bool:
    """For a cancelling job: its pending requests -> cancelled; once none runs, the job -> cancelled (True)."""
    now = now or utcnow()
    queries.cancel_pending_requests(session, job_id, job_status=JOB_CANCELLING, now=now)
    return _change(session, job_id, JOB_CANCELLED, now=now, unless_running_requests=True)


# ---------------------------------------------------------------- finalization (writes the output file)


def finish_finalizing(session_factory: sessionmaker[Session], job_id: str, *, write_output: bool = True) -> bool:
    """A finalizing job: writes its output file (jobs.output_file, when set and write_output), then completes it.
    True for the call that completed it. A failed write is recorded on the job, which completes anyway."""
    with session_factory() as s:
        output_file = queries.get_job(s, job_id).output_file
    error = None
    if write_output and output_file:
        try:
            write_results(session_factory, job_id, output_file)
        except OSError as e:
            error = (
                f"could not write the output file {output_file}: {e} (export with `spec-batch results {job_id} -o ...`)"
            )
    with session_factory.begin() as s:
        return complete(s, job_id, error=error)


def finalize_job(session_factory: sessionmaker[Session], job_id: str, *, write_output: bool = True) -> bool:
    """Completes the job if none of its requests is open: in_progress -> finalizing (one winner) -> the output
    file -> completed. True for the call that completed it; False when requests are open or another process won."""
    with session_factory.begin() as s:
        if not begin_finalizing(s, job_id):
            return False
    return finish_finalizing(session_factory, job_id, write_output=write_output)


# ---------------------------------------------------------------- what a status allows


def check_runnable(job_id: str, status: str) -> None:
    """Raises JobStateError unless the job's requests may be decoded now (in_progress or finalizing)."""
    if status == JOB_VALIDATING:
        raise JobStateError(f"job {job_id} was interrupted while its file was being validated: run the file again")
    if status in (JOB_CANCELLING, JOB_CANCELLED, JOB_FAILED):
        raise JobStateError(f"job {job_id} is {status}; nothing to run")


def is_stopping(status: str) -> bool:
    """A runner holding the job's requests stops at its next step: the job is being (or was) cancelled."""
    return status in (JOB_CANCELLING, JOB_CANCELLED)


def takes_new_work(status: str) -> bool:
    """Whether a runner may claim the job's requests: not once it ended or is being cancelled."""
    return not is_terminal(status) and status != JOB_CANCELLING


def resume_action(job_id: str, status: str) -> str:
    """What resuming the job means (RESUME_*), or JobStateError for a failed, cancelled or cancelling job."""
    if status == JOB_COMPLETED:
        return RESUME_REWRITE_OUTPUT
    if status in (JOB_FAILED, JOB_CANCELLED, JOB_CANCELLING):
        raise JobStateError(f"job {job_id} is {status}; there is nothing to resume")
    if status == JOB_FINALIZING:
        return RESUME_FINISH_FINALIZING
    return RESUME_RUN


__all__ = [
    "ENTERED_AT",
    "INITIAL",
    "RESUME_FINISH_FINALIZING",
    "RESUME_REWRITE_OUTPUT",
    "RESUME_RUN",
    "TRANSITIONS",
    "JobStateError",
    "begin_finalizing",
    "can_change",
    "check_runnable",
    "complete",
    "fail",
    "finalize_job",
    "finish_finalizing",
    "is_stopping",
    "is_terminal",
    "request_cancel",
    "resume_action",
    "settle_cancel",
    "sources_of",
    "start",
    "takes_new_work",
]
