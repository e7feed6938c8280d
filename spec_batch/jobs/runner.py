"""Runs a job's requests through a decoder and stores each result as it completes.

Used by the CLI's local mode (``spec-batch run`` / ``resume``, through ``spec_batch.jobs.service``) and by the
Celery task (``workers/``): ``run_requests(session_factory, job_id, decoder, *, request_ids=None, batch_size=None,
lease=None, should_stop=None, on_progress=None, on_stored=None,
finalize=True, memory=None)``.

- ``request_ids``: the job's requests to run (``None``: all of them). Requests already completed, failed or
  cancelled are skipped, so running the same ids twice, or from two processes at once, stores nothing twice.
- Requests are claimed one group (``GROUP_FACTOR * batch_size``) at a time under the caller's ``lease``
  (spec_batch.jobs.lease.Lease, renewed by the caller's heartbeat: run_job's, a worker's): pending requests, or
  running ones whose lease expired. Without one, the call makes its own and renews it while it runs. A live
  holder's requests are never taken.
- Each result is stored by a conditional UPDATE (a request already done is never stored twice), in one short
  transaction that also adds the decode time since this call's previous stored result to
  ``jobs.decode_wall_s``: a process killed at any moment has its stored tokens and their time counted, and
  the rest of both lost, so the job's tokens/s stays true after a crash and a resume.
- ``should_stop()`` and the job being cancelled (read at most every CANCEL_CHECK_S) stop generate() at its next
  step: rows it did not finish come back ``cancelled`` and go back to pending (a cancelled job then cancels
  them), never stored as results. Ctrl-C or an error gives the claimed but unfinished requests back at once.
- A decode-time error names the request by its line number and custom_id (the errors file), never by its
  place in a batch.
- ``memory``: the job's JobMemory (the suffix drafter drafts from the job's other outputs; outputs never change).
  None: for a suffix decoder, one for this call, warmed from the job's completed outputs (a resume starts with
  the job's history); a worker passes the one it keeps for the job across chunks (jobs.job_memory_store.JobMemories).
- At the end the call reports how it ended to ``lifecycle.after_run``, which settles a job being cancelled and,
  with ``finalize=True``, completes the job once none of its requests is open (conditional updates: exactly one
  process, whichever finishes last, writes the output file and completes the job).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.decoder_like import DecoderLike
from ..core.drafting.job_memory import JobMemory
from ..core.outputs import GenerationResult, RequestStats
from ..settings import get_settings
from ..store import queries
from ..store.models import REQ_FAILED
from .claims import ClaimedRequests, claimed_requests
from .job_memory_store import uses_job_memory, warm_memory
from .lease import Heartbeat, Lease, new_lease
from .lifecycle import RunOutcome, after_run, is_stopping, takes_new_work
from .stats import pooled

GROUP_FACTOR = 4  # requests claimed and handed to generate() at once = GROUP_FACTOR * batch_size
STOPPED_BY_CALLER = "should_stop"
STOPPED_CANCELLED = "cancelled"  # the job is being cancelled
OUTCOMES = {
    None: RunOutcome.FINISHED,
    STOPPED_CANCELLED: RunOutcome.CANCELLED,
    STOPPED_BY_CALLER: RunOutcome.INTERRUPTED,
}
CANCEL_CHECK_S = 1.0  # how often (at most) a running group looks at its job's status
CANCELLED = "cancelled"  # the finish_reason of a row generate() stopped before it finished

# on_stored(status, stats): called after each request row a call stores (status "completed" or "failed"; stats
# None for a request that failed before decoding); workers count their metrics with it.
OnStored = Callable[[str, "RequestStats | None"], None]


@dataclass
class RunReport:
    job_id: str
    claimed: int = 0
    completed: int = 0
    failed: int = 0
    skipped: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    decode_wall_s: float = 0.0
    stopped: str | None = None  # None | STOPPED_BY_CALLER | STOPPED_CANCELLED
    finalized: bool = False

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def stats(self) -> RequestStats:
        """The pooled statistics of the results this call stored (wall time: its decode time)."""
        return pooled(
            output_tokens=self.output_tokens,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            target_forwards=self.target_forwards,
            wall_s=self.decode_wall_s,
        )

    @property
    def acceptance_rate(self) -> float | None:
        return self.stats.acceptance_rate

    @property
    def tokens_per_s(self) -> float | None:
        return self.stats.tokens_per_s

    def add_result(self, result: Any) -> None:
        stats = result.stats
        if result.finish_reason == "error":
            self.failed += 1
        else:
            self.completed += 1
        if stats is not None:
            self.output_tokens += stats.output_tokens or 0
            self.draft_tokens += stats.draft_tokens or 0
            self.accepted_tokens += stats.accepted_tokens or 0
            self.target_forwards += stats.target_forwards or 0


def request_error(result: GenerationResult, batch_index: int) -> str:
    """A decode-time error as stored on its request: the core names a prompt by its place in the batch it was
    given ("prompt 3: ..."), which means nothing to a user; the errors file names the line and custom_id, so a
    bad prompt's error is stored without its place (PromptError.detail)."""
    named = result.prompt_error
    if named is not None and named.prompt_index == batch_index:
        return named.detail
    return result.error or "decoding failed"


def _job_state(session: Session, job_id: str) -> tuple[str, int]:
    job = queries.get_job(session, job_id)
    return job.status, job.batch_size


@contextmanager
def held_lease(
    session_factory: sessionmaker[Session],
    lease: Lease | None,
    worker: str | None = None,
    lease_seconds: float | None = None,
) -> Iterator[Lease]:
    """The caller's lease (the caller's heartbeat renews it), or a new one (token `worker`, or a new token) that a
    heartbeat of this call renews until the block ends."""
    if lease is not None:
        yield lease
        return
    lease = new_lease(lease_seconds, token=worker)
    heartbeat = Heartbeat(session_factory, lease_seconds=lease.seconds)
    heartbeat.hold(lease.token)
    with heartbeat:
        yield lease


def run_requests(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: DecoderLike,
    *,
    request_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
    lease: Lease | None = None,
    worker: str | None = None,
    lease_seconds: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[RunReport], None] | None = None,
    on_stored: OnStored | None = None,
    finalize: bool = True,
    memory: JobMemory | None = None,
) -> RunReport:
    """Runs the job's open requests among `request_ids` (all when None) and stores each result as it completes.

    See the module docstring for the contract (idempotent; safe with overlapping ids in two processes).
    `lease`: the claims' holder, renewed by the caller's heartbeat; None: a new one (token `worker`, length
    `lease_seconds`) renewed by this call. on_stored(status, stats) follows each row this call stores (a
    worker's metrics count exactly what SQL has).
    """
    settings = get_settings()
    if memory is None and uses_job_memory(decoder):
        memory = warm_memory(session_factory, job_id, decoder.tokenizer, settings.suffix_memory_tokens)
    with held_lease(session_factory, lease, worker, lease_seconds) as held:
        return _run_requests(
            session_factory,
            job_id,
            decoder,
            request_ids,
            batch_size,
            held,
            should_stop,
            on_progress,
            on_stored,
            finalize,
            memory,
        )


def _run_requests(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: DecoderLike,
    request_ids: Sequence[int] | None,
    batch_size: int | None,
    lease: Lease,
    should_stop: Callable[[], bool] | None,
    on_progress: Callable[[RunReport], None] | None,
    on_stored: OnStored | None,
    finalize: bool,
    memory: JobMemory | None,
) -> RunReport:
    report = RunReport(job_id=job_id)
    with session_factory.begin() as s:
        status, job_batch_size = _job_state(s, job_id)
        # a chunk reads only its own ids: O(chunk), not O(job)
        open_ids = queries.open_request_ids(s, job_id, request_ids)
    batch_size = batch_size or job_batch_size
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    todo = open_ids
    if request_ids is not None:
        report.skipped += len(set(request_ids)) - len(todo)
    if not takes_new_work(status):
        report.stopped = STOPPED_CANCELLED if is_stopping(status) else None
        report.skipped += len(todo)
        todo = []

    group = GROUP_FACTOR * batch_size
    stop = _Stop(session_factory, job_id, should_stop)
    for start in range(0, len(todo), group):
        if stop(force_check=True):
            break
        _run_group(
            session_factory,
            job_id,
            decoder,
            todo[start : start + group],
            batch_size,
            lease,
            report,
            on_progress,
            on_stored,
            stop,
            memory,
        )
        if stop.reason is not None:
            break
    report.stopped = report.stopped or stop.reason
    report.finalized = after_run(session_factory, job_id, OUTCOMES[report.stopped], finalize=finalize).completed
    return report


class _Stop:
    """generate()'s should_stop: the caller's own, or the job being cancelled (its status is read at most every
    CANCEL_CHECK_S). `reason` says which stopped the run (STOPPED_BY_CALLER or STOPPED_CANCELLED)."""

    def __init__(
        self, session_factory: sessionmaker[Session], job_id: str, should_stop: Callable[[], bool] | None
    ) -> None:
        self.session_factory = session_factory
        self.job_id = job_id
        self.should_stop = should_stop
        self.reason: str | None = None
        self.checked = time.monotonic()

    def __call__(self, force_check: bool = False) -> bool:
        if self.reason is None and self.should_stop is not None and self.should_stop():
            self.reason = STOPPED_BY_CALLER
        now = time.monotonic()
        if self.reason is None and (force_check or now - self.checked >= CANCEL_CHECK_S):
            self.checked = now
            with self.session_factory() as s:
                status, _ = _job_state(s, self.job_id)
            if is_stopping(status):
                self.reason = STOPPED_CANCELLED
        return self.reason is not None


def _run_group(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: DecoderLike,
    ids: list[int],
    batch_size: int,
    lease: Lease,
    report: RunReport,
    on_progress: Callable[[RunReport], None] | None,
    on_stored: OnStored | None,
    stop: _Stop,
    memory: JobMemory | None,
) -> None:
    with claimed_requests(session_factory, job_id, ids, decoder, lease) as batch:
        report.skipped += len(ids) - len(batch.claimed)
        report.claimed += len(batch.claimed)
        for rid, exc in batch.bad:  # this request alone fails; the others go on
            if batch.fail(rid, exc):
                report.failed += 1
                if on_stored is not None:
                    on_stored(REQ_FAILED, None)
                if on_progress is not None:
                    on_progress(report)
            else:
                report.skipped += 1
        if batch.ids:
            on_result = _result_saver(batch, report, on_progress, on_stored)
            decoder.generate(
                batch.prompts,
                batch.params,
                batch_size=batch_size,
                return_errors=True,
                on_result=on_result,
                should_stop=stop,
                memory=memory,
            )


def _result_saver(
    batch: ClaimedRequests,
    report: RunReport,
    on_progress: Callable[[RunReport], None] | None,
    on_stored: OnStored | None,
) -> Callable[[int, Any], None]:
    """generate()'s on_result: stores each finished row with the decode time since the previous one stored."""
    last_commit = [time.perf_counter()]

    def on_result(i: int, result: Any) -> None:
        if result.finish_reason == CANCELLED:  # stopped before it finished: given back at the end, not stored
            return
        if result.finish_reason == "error":
            result = dataclasses.replace(result, error=request_error(result, i))
        now = time.perf_counter()
        decode_s = now - last_commit[0]  # since this call's previous stored result (or the start)
        stored = batch.store_prompt(i, result, decode_s)  # the tokens and their time, in one transaction
        if stored is None:  # more choices of this request to come
            return
        last_commit[0] = now
        if stored:
            report.add_result(result)
            report.decode_wall_s += decode_s
            if on_stored is not None:
                on_stored(queries.result_status(result), result.stats)
        else:
            report.skipped += 1
        if on_progress is not None:
            on_progress(report)

    return on_result
