"""Runs a job's requests through a decoder and stores each result as it completes.

Used by the CLI's local mode (``spec-batch run`` / ``resume``) and by the Celery task (``workers/``).

Runner API
==========

``run_requests(session_factory, job_id, decoder, *, request_ids=None, batch_size=None, worker=None,
lease_seconds=None, should_stop=None, on_progress=None, finalize=True) -> RunReport``

- ``session_factory``: a ``sessionmaker`` from ``spec_batch.store.open_store(url)`` (or ``make_session_factory``).
- ``request_ids``: the job's requests to run (``None``: all of them). Requests already completed, failed or
  cancelled are skipped, so running the same ids twice, or from two processes at once, stores nothing twice.
- ``batch_size``: the decoder's batch size (``None``: the job's ``batch_size`` column).
- Requests are claimed one group (``4 * batch_size``) at a time: ``status='running'``, ``worker``,
  ``attempts += 1``, ``started_at``, ``lease_expires_at = now + lease_seconds`` (``None``: settings'
  ``lease_seconds``). A row is claimable when ``pending``, or ``running`` with an expired or NULL lease.
  The lease of the group's unfinished requests is renewed as results arrive (every lease_seconds / 3).
  The group is decoded with ``decoder.generate(prompts, params, batch_size=..., return_errors=True,
  on_result=...)``; each result is stored in its own short transaction by a conditional
  ``UPDATE requests ... WHERE id = :id AND status IN ('pending', 'running')`` (finish_reason ``error`` ->
  status ``failed`` with ``error``; the others go on). A chat request whose messages the model's chat
  template rejects fails alone, before decoding.
- Between groups: ``should_stop()`` is checked, and the job's status (``cancelling``/``cancelled`` stops it).
  The seconds spent in ``generate`` are added to ``jobs.decode_wall_s`` (atomic ``UPDATE ... + :s``).
  On an exception (Ctrl-C) the claimed but unfinished requests go back to ``pending``; after a SIGKILL they
  stay ``running`` until their lease expires (``spec-batch resume`` releases them at once).
- ``on_progress(report)``: called after each stored result with the running ``RunReport``.
- ``finalize=True``: when no request of the job is pending or running any more, ``finalize_job`` is called;
  its conditional UPDATEs make exactly one process, whichever finishes last, complete the job.

``RunReport``: ``job_id, claimed, completed, failed, skipped`` (counts stored by *this* call; skipped = already
done or claimed by someone else), ``output_tokens, draft_tokens, accepted_tokens, target_forwards,
decode_wall_s``, ``stopped`` (``None`` | ``"should_stop"`` | ``"cancelled"``), ``finalized`` (this call
completed the job); properties ``acceptance_rate``, ``tokens_per_s``.

``finalize_job(session_factory, job_id, *, write_output=True) -> bool``: ``in_progress -> finalizing`` (only
when nothing is pending/running; conditional, one winner), writes ``jobs.output_file`` (+ ``.errors.jsonl``)
when set and ``write_output``, then ``finalizing -> completed``. True for the one call that completed it.

Store API (``spec_batch.store``; every function takes a caller-owned Session: ``with factory.begin() as s:``)
-----------------------------------------------------------------------------------------------------------
- ``open_store(url=None) -> sessionmaker``: engine for ``url`` (default: settings' database_url);
  SQLite is migrated to head automatically, a server must be at head (``spec-batch db upgrade``).
- ``make_engine(url)``, ``make_session_factory(engine)``, ``migrate_to_head(url_or_engine)``,
  ``downgrade(url_or_engine, revision)``, ``current_revision(engine)``, ``head_revision()``.
- Tables ``Job``, ``Request`` (``spec_batch.store.models``); status constants ``JOB_*``, ``REQ_*``; the view
  ``job_summary`` (a ``Table`` for ``select(job_summary)``).
- ``queries``: ``get_job, resolve_job_id(prefix), open_request_ids(job_id), request_ids(job_id, statuses),
  claim_requests, renew_leases, release_requests, release_running(job_id), save_result, save_failure, add_decode_time,
  record_baseline, begin_finalize, complete_job, fail_job, request_cancel, try_finish_cancel, job_counts,
  job_summary_row, list_job_summaries, stats_by_model``.

Job service (``spec_batch.jobs``):
- ``create_job_from_file(session_factory, path, *, target, drafter, output_file=None, batch_size=8,
  baseline_sample=8, sampling_defaults=None, metadata=None, queue=None, chunk_size=None, job_id=None)
  -> (job_id, ParseReport)``: validates the file, inserts the job and one request row per non-blank line
  (invalid lines as failed rows), status ``in_progress`` (``failed`` when no line is valid).
- ``measure_baseline(session_factory, job_id, decoder, *, sample_size=None, worker=None) -> Baseline | None``:
  once per job; decodes the sample with and without speculation, stores both timings on the job and keeps
  the speculative results as the sample requests' results.
- ``run_job(session_factory, job_id, decoder, *, baseline=True, should_stop=None, on_progress=None,
  on_phase=None, worker=None) -> RunReport``: baseline, then ``run_requests`` over every open request.
- ``resume_job(session_factory, job_id, decoder, **kw)``: ``release_running`` then ``run_job``.
- ``write_results(session_factory, job_id, out_path) -> ResultsReport``: OUT.jsonl + OUT.errors.jsonl.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.outputs import RequestStats
from ..core.sampling import SamplingParams
from ..errors import ChatTemplateError, SpecBatchError
from ..settings import get_settings
from ..store import queries
from ..store.models import JOB_CANCELLED, JOB_CANCELLING, JOB_TERMINAL
from .export import write_results
from .stats import pooled

GROUP_FACTOR = 4  # requests claimed and handed to generate() at once = GROUP_FACTOR * batch_size
STOPPED_BY_CALLER = "should_stop"
STOPPED_CANCELLED = "cancelled"  # the job is being cancelled


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


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
            output_tokens=self.output_tokens, draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            target_forwards=self.target_forwards, wall_s=self.decode_wall_s,
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


def build_prompt(decoder: Any, endpoint: str, prompt: Any) -> str | list[int]:
    """The decoder's input for a stored request: chat messages through the target's chat template."""
    if endpoint == "/v1/chat/completions":
        return decoder.apply_chat_template(prompt)
    return prompt


def prompt_error_code(exc: BaseException) -> str:
    if isinstance(exc, ChatTemplateError):
        return "chat_template_error"
    if isinstance(exc, SpecBatchError):
        return "invalid_request"
    return "internal_error"


def _job_state(session: Session, job_id: str) -> tuple[str, int]:
    job = queries.get_job(session, job_id)
    return job.status, job.batch_size


def run_requests(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: Any,
    *,
    request_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
    worker: str | None = None,
    lease_seconds: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[RunReport], None] | None = None,
    finalize: bool = True,
) -> RunReport:
    """Runs the job's open requests among `request_ids` (all when None) and stores each result as it completes.

    See the module docstring for the contract (idempotent; safe with overlapping ids in two processes).
    """
    report = RunReport(job_id=job_id)
    worker = worker or default_worker_name()
    if lease_seconds is None:
        lease_seconds = get_settings().lease_seconds
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
    if status in JOB_TERMINAL or status == JOB_CANCELLING:
        report.stopped = STOPPED_CANCELLED if status in (JOB_CANCELLING, JOB_CANCELLED) else None
        report.skipped += len(todo)
        todo = []

    group = GROUP_FACTOR * batch_size
    for start in range(0, len(todo), group):
        if start > 0:
            if should_stop is not None and should_stop():
                report.stopped = STOPPED_BY_CALLER
                break
            with session_factory.begin() as s:
                status, _ = _job_state(s, job_id)
            if status in (JOB_CANCELLING, JOB_CANCELLED):
                report.stopped = STOPPED_CANCELLED
                break
        elif should_stop is not None and should_stop():
            report.stopped = STOPPED_BY_CALLER
            break
        _run_group(session_factory, job_id, decoder, todo[start : start + group], batch_size, worker,
                   lease_seconds, report, on_progress)

    if report.stopped == STOPPED_CANCELLED:
        with session_factory.begin() as s:
            queries.try_finish_cancel(s, job_id)
    elif finalize and report.stopped is None:
        report.finalized = finalize_job(session_factory, job_id)
    return report


def _run_group(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: Any,
    ids: list[int],
    batch_size: int,
    worker: str,
    lease_seconds: float,
    report: RunReport,
    on_progress: Callable[[RunReport], None] | None,
) -> None:
    with session_factory.begin() as s:
        claimed = queries.claim_requests(s, job_id, ids, worker=worker, lease_seconds=lease_seconds)
        rows = queries.request_inputs(s, claimed)
    report.skipped += len(ids) - len(claimed)
    report.claimed += len(claimed)
    if not claimed:
        return

    unfinished = set(claimed)
    prompts: list[str | list[int]] = []
    params: list[SamplingParams] = []
    order: list[int] = []
    try:
        for rid in claimed:
            row = rows[rid]
            try:
                built = build_prompt(decoder, row.endpoint, row.prompt)
                sp = SamplingParams.from_dict(row.params)
            except Exception as e:  # this request alone fails; the others go on
                with session_factory.begin() as s:
                    stored = queries.save_failure(s, rid, prompt_error_code(e), str(e), worker=worker)
                unfinished.discard(rid)
                if stored:
                    report.failed += 1
                    if on_progress is not None:
                        on_progress(report)
                else:
                    report.skipped += 1
                continue
            prompts.append(built)
            params.append(sp)
            order.append(rid)
        if not order:
            return

        renewed = [time.monotonic()]

        def on_result(i: int, result: Any) -> None:
            rid = order[i]
            with session_factory.begin() as s:
                stored = queries.save_result(s, rid, result, worker=worker)
                unfinished.discard(rid)
                if unfinished and time.monotonic() - renewed[0] > lease_seconds / 3:  # a long group keeps its claim
                    queries.renew_leases(s, sorted(unfinished), worker=worker, lease_seconds=lease_seconds)
                    renewed[0] = time.monotonic()
            if stored:
                report.add_result(result)
            else:
                report.skipped += 1
            if on_progress is not None:
                on_progress(report)

        t0 = time.perf_counter()
        try:
            decoder.generate(prompts, params, batch_size=batch_size, return_errors=True, on_result=on_result)
        finally:
            elapsed = time.perf_counter() - t0
            report.decode_wall_s += elapsed
            with session_factory.begin() as s:
                queries.add_decode_time(s, job_id, elapsed)
    finally:
        if unfinished:  # Ctrl-C or an error in generate(): give the rest back at once
            with session_factory.begin() as s:
                queries.release_requests(s, sorted(unfinished), worker=worker)


def finalize_job(session_factory: sessionmaker[Session], job_id: str, *, write_output: bool = True) -> bool:
    """Completes the job if no request is open: in_progress -> finalizing (one winner) -> write the output
    file (jobs.output_file, when set and write_output) -> completed. True for the call that completed it."""
    with session_factory.begin() as s:
        if not queries.begin_finalize(s, job_id):
            return False
        output_file = queries.get_job(s, job_id).output_file
    error = None
    if write_output and output_file:
        try:
            write_results(session_factory, job_id, output_file)
        except OSError as e:
            error = f"could not write the output file {output_file}: {e} (export with `spec-batch results {job_id} -o ...`)"
    with session_factory.begin() as s:
        return queries.complete_job(s, job_id, error=error)
