"""The job service: create a job from a batch file, measure its baseline, run, resume and cancel it.

Used by the CLI (``spec-batch run / resume / cancel``) and by the queue (spec_batch.workers), which reuses
create_job_from_file and measure_baseline and runs requests with ``spec_batch.jobs.runner.run_requests``.
The service never talks to the broker: a caller that resumes a queued job passes the queue's enqueue function.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.decoder_like import DecoderLike
from ..store import chunks, queries
from ..store.models import REQ_RUNNING
from . import lifecycle
from .baseline import measure_baseline
from .export import write_results
from .job_create import (  # creating a job: the service's names
    create_job_from_file,
    new_job_id,
    sampling_defaults_with,
    store_validated,
    validate_file,
)
from .lease import Holder, take_over_dead_holders
from .lifecycle import JobStateError
from .runner import RunReport, held_lease, run_requests

# ---------------------------------------------------------------- running


def run_job(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: DecoderLike,
    *,
    baseline: bool = True,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[RunReport], None] | None = None,
    on_phase: Callable[[str, Any], None] | None = None,
    worker: str | None = None,
    lease_seconds: float | None = None,
) -> RunReport:
    """Local mode: the baseline (once per job), then every open request, then finalization (output file).
    Every claim is held by one lease (token `worker`, new when None), which a heartbeat renews meanwhile.

    on_phase(name, info): "baseline" (info: sample size) before it, "baseline_done" (info: Baseline | None),
    "run" (info: number of open requests) before the requests.
    """
    with session_factory.begin() as s:
        job = queries.get_job(s, job_id)
        status, measure = job.status, baseline and lifecycle.wants_baseline(job)
        k = min(job.baseline_sample, job.n_requests - job.n_invalid)  # the sample is at most the valid requests
    lifecycle.check_runnable(job_id, status)
    with held_lease(session_factory, None, worker, lease_seconds) as lease:
        if measure:
            if on_phase:
                on_phase("baseline", k)
            b = measure_baseline(session_factory, job_id, decoder, lease=lease)
            if on_phase:
                on_phase("baseline_done", b)
        if on_phase:
            with session_factory.begin() as s:
                on_phase("run", len(queries.open_request_ids(s, job_id)))
        return run_requests(
            session_factory,
            job_id,
            decoder,
            lease=lease,
            should_stop=should_stop,
            on_progress=on_progress,
        )


class JobBusyError(JobStateError):
    """Another live process holds some of the job's requests: they are left to it."""

    def __init__(self, job_id: str, holders: Sequence[Holder]):
        self.job_id = job_id
        self.holders = list(holders)
        super().__init__(
            f"job {job_id} is being run by another process: {'; '.join(map(str, holders))}. Nothing was taken "
            f"over: wait for it to finish, or run `spec-batch resume --wait {job_id}`, which continues once it "
            f"finishes or dies (a dead process on another machine lets go when its lease expires)"
        )


def wait_until_free(
    session_factory: sessionmaker[Session],
    job_id: str,
    *,
    wait: bool = False,
    poll_s: float = 2.0,
    on_wait: Callable[[JobBusyError], None] | None = None,
) -> None:
    """Takes over the job's requests whose holder is gone (lease expired, or a dead process of this machine);
    when a live process holds some, raises JobBusyError, or with `wait` polls until none does."""
    while True:
        live = take_over_dead_holders(session_factory, job_id)
        if not live:
            return
        busy = JobBusyError(job_id, live)
        if not wait:
            raise busy
        if on_wait is not None:
            on_wait(busy)
        time.sleep(poll_s)


def resume_job(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: DecoderLike,
    *,
    wait: bool = False,
    poll_s: float = 2.0,
    on_wait: Callable[[JobBusyError], None] | None = None,
    **kwargs: Any,
) -> RunReport:
    """After Ctrl-C or a kill: requests a dead process left running go back to pending, then run_job. A live
    process's requests are never taken over (JobBusyError, or wait; see wait_until_free). A job killed while
    finalizing is finalized again (its output file rewritten)."""
    with session_factory() as s:
        status = queries.get_job(s, job_id).status
    if lifecycle.is_finalizing(status):
        return RunReport(job_id=job_id, finalized=lifecycle.finish_finalizing(session_factory, job_id))
    if not lifecycle.is_terminal(status):
        wait_until_free(session_factory, job_id, wait=wait, poll_s=poll_s, on_wait=on_wait)
    return run_job(session_factory, job_id, decoder, **kwargs)


@dataclass
class JobInfo:
    """What a caller needs to decide how to continue a job."""

    job_id: str
    status: str
    target: str
    drafter: str
    input_file: str | None
    output_file: str | None
    queue: str | None


def job_info(session_factory: sessionmaker[Session], job_id: str) -> JobInfo:
    with session_factory() as s:
        j = queries.get_job(s, job_id)
        return JobInfo(j.id, j.status, j.target, j.drafter, j.input_file, j.output_file, j.queue)


@dataclass
class ResumeOutcome:
    """What resume did: "completed" (nothing to do; a missing output file was written again), "enqueued"
    (a queued job went back to its workers: `enqueued` is the enqueue function's report; `running` chunks are
    left to the workers that hold them) or "ran" (decoded here: `report`)."""

    action: str
    info: JobInfo
    report: RunReport | None = None
    enqueued: Any = None
    running: int = 0


def resume(
    session_factory: sessionmaker[Session],
    job_id: str,
    *,
    decoder_for: Callable[[str, str], Any],
    enqueue: Callable[[sessionmaker[Session], str], Any] | None = None,
    wait: bool = False,
    poll_s: float = 2.0,
    on_wait: Callable[[JobBusyError], None] | None = None,
    **run_kwargs: Any,
) -> ResumeOutcome:
    """Continues a job the way it was started: a queued job goes back to its workers (`enqueue`, e.g.
    spec_batch.workers.enqueue.enqueue_job: the jobs layer never talks to the broker; chunks a live worker holds stay
    with it), a local one is decoded in this process with `decoder_for(target, drafter)` once no live process
    holds any of its requests (JobBusyError, or `wait`). A completed job only gets its output file back if it is
    missing. Raises JobStateError for a failed, cancelled or cancelling job."""
    info = job_info(session_factory, job_id)
    action = lifecycle.resume_action(job_id, info.status)
    if action == lifecycle.RESUME_REWRITE_OUTPUT:
        if info.output_file and not Path(info.output_file).exists():
            write_results(session_factory, job_id, info.output_file)
        return ResumeOutcome("completed", info)
    if info.queue is not None:
        if enqueue is None:
            raise JobStateError(f"job {job_id} runs on the queue {info.queue}: resume it where the queue is reachable")
        enqueued = enqueue(session_factory, job_id)
        with session_factory() as s:
            running = len(chunks.running_chunk_holders(s, job_id))
        return ResumeOutcome("enqueued", info, enqueued=enqueued, running=running)
    if action == lifecycle.RESUME_RUN:  # before loading the model: a busy job is refused at once
        wait_until_free(session_factory, job_id, wait=wait, poll_s=poll_s, on_wait=on_wait)
    decoder = decoder_for(info.target, info.drafter)
    report = resume_job(session_factory, job_id, decoder, wait=wait, poll_s=poll_s, on_wait=on_wait, **run_kwargs)
    return ResumeOutcome("ran", info, report=report)


# ---------------------------------------------------------------- cancel


@dataclass
class CancelOutcome:
    job_id: str
    status: str  # the job's status afterwards: cancelling (requests still running) or cancelled
    running: int  # requests still running (they stop at their next decoding step)


def expire_job(session_factory: sessionmaker[Session], job_id: str, *, now: datetime | None = None) -> bool:
    """A batch whose completion_window ended while it ran: in_progress -> expired with what was done (lifecycle.expire:
    its pending requests cancelled as batch_expired); its queued chunks are dropped, and a runner holding some of
    its requests stops at its next step and hands them back, which after_run cancels as expired too. True for the
    call that expired it."""
    with session_factory.begin() as s:
        expired = lifecycle.expire(s, job_id, now=now)
        if expired:
            chunks.cancel_queued_chunks(s, job_id)
    return expired


def cancel_job(session_factory: sessionmaker[Session], job_id: str) -> CancelOutcome:
    """validating/in_progress -> cancelling: queued chunks are dropped, pending requests are cancelled, and the
    job is cancelled as soon as nothing runs. Cancelling a cancelled job again is a no-op; any other status
    raises JobStateError."""
    with session_factory.begin() as s:
        status = queries.get_job(s, job_id).status
        changed = lifecycle.request_cancel(s, job_id)
        if changed:
            chunks.cancel_queued_chunks(s, job_id)
    if not changed and not lifecycle.is_stopping(status):
        raise JobStateError(f"job {job_id} is {status}; it cannot be cancelled")
    lifecycle.after_run(session_factory, job_id, lifecycle.RunOutcome.CANCELLED)  # cancelled now if nothing runs
    with session_factory.begin() as s:
        status = queries.get_job(s, job_id).status
        running = queries.job_counts(s, job_id)[REQ_RUNNING]
    return CancelOutcome(job_id, status, running)


__all__ = [
    "CancelOutcome",
    "JobBusyError",
    "JobInfo",
    "JobStateError",
    "ResumeOutcome",
    "cancel_job",
    "create_job_from_file",
    "expire_job",
    "job_info",
    "measure_baseline",
    "new_job_id",
    "resume",
    "resume_job",
    "run_job",
    "sampling_defaults_with",
    "store_validated",
    "validate_file",
    "wait_until_free",
]
