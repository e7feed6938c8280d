"""The job lifecycle: every status a job can have, which changes are allowed, and the one function per change.

The statuses are OpenAI's Batch API's (docs/architecture.md has the diagram)::

    validating -> in_progress -> finalizing -> completed
         |             |             |
         +-------------+-------------+--> failed          (the job as a whole: no valid line, ...)
         |             |
         +-------------+--> cancelling -> cancelled       (once none of its requests runs)
                       |
                       +--> expired                       (a batch of the API not finished within its window)

An expired job keeps what was done: its pending requests are cancelled with the code `batch_expired` at once, and
those running when it expired once their runner stops (it stops at its next step, as for a cancel).

Each change is one conditional UPDATE whose allowed source statuses come from TRANSITIONS, so processes racing
on a job change it once (the one that did gets True). No job status is assigned anywhere else (store/ writes the
rows; tests/test_job_status_rules.py checks both).

Callers report what happened and this module decides what the job does next: ``after_run(session_factory, job_id,
outcome)`` when a run of a job's requests ends (the runner, a worker's task, the reaper, the server's batch
runner) settles a cancelling job, completes a finished one or fails a broken one; ``wants_baseline(job)`` says
whether a job's speedup is still to be measured. Other code reads a status only through the predicates below
(``is_terminal``, ``is_stopping``, ``is_running``, ``takes_new_work``) or to show it.

Resuming is not a status: `resume_action` says what continuing a job means in each status.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..errors import SpecBatchError
from ..store import queries
from ..store.models import (
    JOB_CANCELLED,
    JOB_CANCELLING,
    JOB_COMPLETED,
    JOB_EXPIRED,
    JOB_FAILED,
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    JOB_STATUSES,
    JOB_TERMINAL,
    JOB_VALIDATING,
    Job,
    utcnow,
)
from .export import write_results

INITIAL = JOB_VALIDATING  # store.queries.insert_job stores a job with this status; it leaves it by start or fail

# status -> the statuses it may change to
TRANSITIONS: dict[str, frozenset[str]] = {
    JOB_VALIDATING: frozenset({JOB_IN_PROGRESS, JOB_FAILED, JOB_CANCELLING}),
    JOB_IN_PROGRESS: frozenset({JOB_FINALIZING, JOB_FAILED, JOB_CANCELLING, JOB_EXPIRED}),
    JOB_FINALIZING: frozenset({JOB_COMPLETED, JOB_FAILED}),
    JOB_CANCELLING: frozenset({JOB_CANCELLED}),
    JOB_COMPLETED: frozenset(),
    JOB_FAILED: frozenset(),
    JOB_CANCELLED: frozenset(),
    JOB_EXPIRED: frozenset(),
}

# the timestamp column set when a job enters a status
ENTERED_AT = {
    JOB_IN_PROGRESS: "started_at",
    JOB_FINALIZING: "finalizing_at",
    JOB_COMPLETED: "completed_at",
    JOB_FAILED: "failed_at",
    JOB_CANCELLED: "cancelled_at",
    JOB_EXPIRED: "expired_at",
}
EXPIRED_CODE = "batch_expired"  # the error code of the requests an expired batch did not run (OpenAI's)
EXPIRED_MESSAGE = "the batch expired (its completion_window ended) before this request ran"

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


def fail_validating(session: Session, job_id: str, error: str, *, now: datetime | None = None) -> bool:
    """validating -> failed, and only from validating: its file failed validation (a job that left validating
    meanwhile, cancelled or started by another process validating it too, is not touched). True for the one caller
    that failed it."""
    return queries.change_job_status(
        session,
        job_id,
        sources=(JOB_VALIDATING,),
        target=JOB_FAILED,
        values={"failed_at": now or utcnow(), "error": error},
    )


def fail_stale_validating(session: Session, job_id: str, error: str, *, now: datetime | None = None) -> bool:
    """validating -> failed, and only from validating: a job whose validation never finished (the process that
    validated it died). Request rows it may have are cancelled. True for the one caller that failed it."""
    now = now or utcnow()
    failed = fail_validating(session, job_id, error, now=now)
    if failed:
        queries.cancel_pending_requests(
            session, job_id, job_status=JOB_FAILED, now=now, code="validation_abandoned", message=error
        )
    return failed


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


def expire(session: Session, job_id: str, *, now: datetime | None = None) -> bool:
    """in_progress -> expired: the batch's completion_window ended. Its pending requests are cancelled
    (batch_expired) in the same transaction; running ones once their runner stops (settle_expired). True for the
    one call that expired it."""
    now = now or utcnow()
    if not _change(session, job_id, JOB_EXPIRED, now=now):
        return False
    settle_expired(session, job_id, now=now)
    return True


def settle_expired(session: Session, job_id: str, *, now: datetime | None = None) -> int:
    """For an expired job: its pending requests (those handed back by a runner that stopped) -> cancelled with
    batch_expired. Returns how many."""
    return queries.cancel_pending_requests(
        session, job_id, job_status=JOB_EXPIRED, now=now, code=EXPIRED_CODE, message=EXPIRED_MESSAGE
    )


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
    if status in (JOB_CANCELLING, JOB_CANCELLED, JOB_FAILED, JOB_EXPIRED):
        raise JobStateError(f"job {job_id} is {status}; nothing to run")


def is_validating(status: str) -> bool:
    """The job's file is still being validated (validating): nothing of it runs yet."""
    return status == JOB_VALIDATING


def is_stopping(status: str) -> bool:
    """A runner holding the job's requests stops at its next step: the job is being (or was) cancelled, or it
    expired."""
    return status in (JOB_CANCELLING, JOB_CANCELLED, JOB_EXPIRED)


def takes_new_work(status: str) -> bool:
    """Whether a runner may claim the job's requests: not once it ended or is being cancelled."""
    return not is_terminal(status) and status != JOB_CANCELLING


def is_running(status: str) -> bool:
    """The job has started and its requests are being decoded (in_progress): the only status in which it gets new
    queue chunks, its orphaned requests are adopted, and its baseline is measured."""
    return status == JOB_IN_PROGRESS


def is_finalizing(status: str) -> bool:
    """A process began finalizing the job (finalizing): what is left is finish_finalizing."""
    return status == JOB_FINALIZING


def wants_baseline(job: Job) -> bool:
    """Whether the job's speedup is still to be measured: it is running, asks for a sample, has valid requests to
    take it from, and has no baseline yet (the first measurement wins)."""
    return (
        is_running(job.status)
        and job.baseline_sample > 0
        and job.n_requests > job.n_invalid
        and job.baseline_wall_s is None
    )


# ---------------------------------------------------------------- after a run: what the job does next


class RunOutcome(Enum):
    """How a run of a job's requests ended, as its caller reports it to after_run."""

    FINISHED = "finished"  # it ran every request it was given to the end (or found none left to run)
    CANCELLED = "cancelled"  # it stopped because the job is being cancelled
    INTERRUPTED = "interrupted"  # it stopped for its own reason (a stop, a lost lease, a vanished holder): the job
    # goes on in a later run or another process
    BROKEN = "broken"  # the job cannot run at all here (after_run's `error` says why)


@dataclass(frozen=True)
class Settled:
    """What after_run did to the job: at most one of these is True (the call that changed it)."""

    completed: bool = False
    cancelled: bool = False
    failed: bool = False

    @property
    def ended(self) -> bool:
        return self.completed or self.cancelled or self.failed


def after_run(
    session_factory: sessionmaker[Session],
    job_id: str,
    outcome: RunOutcome,
    *,
    finalize: bool = True,
    error: str | None = None,
) -> Settled:
    """Decides and does what the job does now that a run of its requests ended:

    - BROKEN: the job fails with `error`;
    - a job being cancelled (whatever the run saw) is cancelled once none of its requests runs (settle_cancel);
    - FINISHED (and `finalize`): the job completes if none of its requests is open (finalize_job: exactly one
      process, whichever finishes last, writes the output file);
    - otherwise nothing changes: the job's open requests wait for the next run.
    """
    if outcome is RunOutcome.BROKEN:
        with session_factory.begin() as s:
            return Settled(failed=fail(s, job_id, error or "the job could not run"))
    with session_factory.begin() as s:
        status = queries.get_job(s, job_id).status
        if status == JOB_EXPIRED:  # what its runner handed back is cancelled as expired
            settle_expired(s, job_id)
            return Settled()
        if is_stopping(status):
            return Settled(cancelled=settle_cancel(s, job_id))
    if outcome is RunOutcome.FINISHED and finalize and is_running(status):
        return Settled(completed=finalize_job(session_factory, job_id))
    return Settled()


def resume_action(job_id: str, status: str) -> str:
    """What resuming the job means (RESUME_*), or JobStateError for a failed, cancelled or cancelling job."""
    if status == JOB_COMPLETED:
        return RESUME_REWRITE_OUTPUT
    if status in (JOB_FAILED, JOB_CANCELLED, JOB_CANCELLING, JOB_EXPIRED):
        raise JobStateError(f"job {job_id} is {status}; there is nothing to resume")
    if status == JOB_FINALIZING:
        return RESUME_FINISH_FINALIZING
    return RESUME_RUN


__all__ = [
    "ENTERED_AT",
    "EXPIRED_CODE",
    "INITIAL",
    "RESUME_FINISH_FINALIZING",
    "RESUME_REWRITE_OUTPUT",
    "RESUME_RUN",
    "TRANSITIONS",
    "JobStateError",
    "RunOutcome",
    "Settled",
    "after_run",
    "begin_finalizing",
    "can_change",
    "check_runnable",
    "complete",
    "expire",
    "fail",
    "fail_stale_validating",
    "fail_validating",
    "finalize_job",
    "finish_finalizing",
    "is_finalizing",
    "is_running",
    "is_stopping",
    "is_terminal",
    "is_validating",
    "request_cancel",
    "resume_action",
    "settle_cancel",
    "settle_expired",
    "sources_of",
    "start",
    "takes_new_work",
    "wants_baseline",
]
