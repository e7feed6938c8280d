"""The Celery task of spec-batch: run one chunk of a job's requests through the runner.

``process_chunk(chunk_id)`` takes an id, re-reads everything from SQL and is idempotent:

1. it claims the chunk (``queue_chunks``; see workers/reaper.py) or does nothing: a chunk already done, or held
   by a live worker, or of a finished job, makes a duplicate message harmless;
2. the chunk's lease (and its requests' leases) are renewed by this process's heartbeat thread;
3. the job's models are loaded once per worker process, lazily, and stay loaded (spec_batch.loading's
   per-process cache, keyed by target and drafter: a worker may serve several queues);
4. the first chunk of a job measures the job's baseline (``spec_batch.jobs.measure_baseline``);
5. ``spec_batch.jobs.runner.run_requests`` claims, decodes and stores the requests (a request that raises fails
   alone with its error stored). At its next decoding step the task stops when the job is being cancelled or
   another worker took the chunk over; the runner reports how it ended to ``lifecycle.after_run``, which
   completes the job exactly once, in whichever worker stores its last result (conditional updates).

Failures: a transient one (the database or the broker unreachable) gives the chunk back and retries with
exponential backoff; anything else fails the task without retry (a request's own error never gets here: it
is stored on the request). A chunk that ran past the soft time limit is given back with its finished requests
stored; the reaper re-queues the rest.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_ready, worker_shutdown

from spec_batch.core.decoder_like import DecoderLike
from spec_batch.errors import SpecBatchError
from spec_batch.jobs import lease, lifecycle, measure_baseline
from spec_batch.jobs.job_memory_store import uses_job_memory
from spec_batch.jobs.lifecycle import RunOutcome
from spec_batch.jobs.runner import STOPPED_BY_CALLER, STOPPED_CANCELLED, run_requests
from spec_batch.settings import get_settings
from spec_batch.store import chunks, queries
from spec_batch.store.models import REQ_FAILED

from . import metrics
from .celery_app import TASK_NAME_PROCESS_CHUNK, app
from .retries import MAX_RETRIES, is_transient, retry_delay
from .runtime import Runtime, apply_torch_threads, runtime, runtime_of_this_process, stop_in_this_process

log = logging.getLogger("spec_batch.workers")

TAKEN_OVER = "taken over"  # a chunk stopped because another worker holds it now


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """Main worker process, before the pool forks: pick torch threads per process when several share a
    machine (SPEC_BATCH_TORCH_THREADS, or cores / concurrency). No database or model is touched here, so
    nothing is shared across the fork. The choice goes through the environment, which the pool children inherit
    and read through Settings like every other setting."""
    settings = get_settings()
    if settings.torch_threads is None:
        concurrency = int(getattr(sender, "concurrency", 1) or 1)
        if concurrency > 1:
            os.environ["SPEC_BATCH_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // concurrency))
    if settings.metrics_port is not None:  # before the fork: the children write where this process reads
        metrics.prepare()


@worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    """A new pool child: its own engine, heartbeat and reaper (an idle worker still recovers lost chunks)."""
    apply_torch_threads()
    try:
        _runtime()
    except Exception as exc:  # the database may be down now; the first task retries
        log.warning("worker process start: %s (will retry on the first task)", exc)


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    """The main process serves the metrics (SPEC_BATCH_METRICS_PORT). Solo/threads pools run tasks in the main
    process: start the runtime there."""
    port = get_settings().metrics_port
    if port is not None:
        metrics.serve(port)
    pool = getattr(getattr(sender, "controller", None), "pool_cls", None) or app.conf.worker_pool
    name = f"{getattr(pool, '__module__', '')}.{getattr(pool, '__name__', pool)}".lower()
    if "solo" in name or "thread" in name:  # never prefork: its main process must own no engine to fork
        apply_torch_threads()
        try:
            _runtime()
        except Exception as exc:
            log.warning("worker start: %s (will retry on the first task)", exc)


def _runtime() -> Runtime:
    """This process's runtime, announcing the queues the worker consumes (celery's -Q, selected before the pool
    forks) once it has one."""
    rt = runtime()
    if not rt.queues:
        rt.serve_queues(app.amqp.queues.consume_from)
    return rt


@worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    stop_in_this_process()
    metrics.process_exited()


@worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    stop_in_this_process()  # solo/threads pools: the runtime is the main process's
    metrics.shutdown()


# ---------------------------------------------------------------- the task


@app.task(
    bind=True,
    name=TASK_NAME_PROCESS_CHUNK,
    max_retries=MAX_RETRIES,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
)
def process_chunk(self, chunk_id: str) -> dict[str, Any]:
    token = lease.new_token()
    try:
        rt = _runtime()
    except Exception as exc:  # the database is down or not migrated yet: the environment, not the input
        delay = retry_delay(self.request.retries)
        log.error(
            "chunk %s: this worker cannot open the job database (%s); retry %d in %.1fs",
            chunk_id,
            lease.brief(exc),
            self.request.retries + 1,
            delay,
        )
        raise self.retry(exc=exc, countdown=delay) from exc
    try:
        return _process(rt, chunk_id, token)
    except SoftTimeLimitExceeded:
        log.warning("chunk %s ran past its soft time limit; giving the rest back", chunk_id)
        _give_back(chunk_id, token)
        return {"chunk": chunk_id, "stopped": "time_limit"}
    except Exception as exc:
        if is_transient(exc):
            _give_back(chunk_id, token)
            delay = retry_delay(self.request.retries)
            log.warning(
                "chunk %s: transient failure (%s); retry %d in %.1fs",
                chunk_id,
                lease.brief(exc),
                self.request.retries + 1,
                delay,
            )
            raise self.retry(exc=exc, countdown=delay) from exc
        _give_back(chunk_id, token)
        raise


def _give_back(chunk_id: str, token: str) -> None:
    """Ends this attempt without finishing the chunk: its lease ends now, so a reaper re-queues the rest at
    once (attempt counting included). When even that fails (database down), the lease runs out by itself, and
    this process may take the chunk back at once (it knows the attempt was abandoned)."""
    rt = runtime_of_this_process()
    lease.abandon(token)
    if rt is None:
        return
    rt.heartbeat.drop(token)
    try:
        with rt.session_factory.begin() as s:
            chunks.expire_chunk(s, chunk_id, token)
        rt.heartbeat.poke()
    except Exception as exc:
        log.warning("chunk %s: could not give it back now (%s); its lease will expire", chunk_id, lease.brief(exc))


@dataclass
class _ChunkWork:
    """A chunk this attempt claimed, with what running it needs from its job."""

    job_id: str
    request_ids: list[int]
    target: str
    drafter: str
    batch_size: int
    measure: bool
    cancelling: bool
    # the job's precision (none stored: an older job, or full weights at the device's dtype)
    precision: dict[str, str] = field(default_factory=dict)


def _claim(rt: Runtime, chunk_id: str, token: str) -> _ChunkWork | str:
    """Claims the chunk for `token` (taking it from a dead or expired holder, whose requests go back to pending);
    or why not (a skip reason)."""
    with rt.session_factory.begin() as s:
        chunk = chunks.get_chunk(s, chunk_id)
        if chunk is None:
            log.warning("chunk %s is not in the database (a submit rolled back?); nothing to do", chunk_id)
            return "unknown chunk"
        if chunk.state in (chunks.CHUNK_DONE, chunks.CHUNK_SPLIT):
            return f"chunk {chunk.state}"
        job = queries.get_job(s, chunk.job_id)
        if lifecycle.is_terminal(job.status):
            chunks.finish_chunk(s, chunk.id, None)
            rt.memories.drop(job.id)
            return f"job {job.status}"
        previous = chunk.worker if chunk.state == chunks.CHUNK_RUNNING else None
        take_from = previous if previous and lease.holder_is_dead(previous) else None
        if not chunks.claim_chunk(s, chunk.id, token, rt.settings.lease_seconds, take_from=take_from):
            return f"held by {chunk.worker}"
        if previous:  # its lease expired or it is known dead: its unfinished requests are claimable now
            chunks.release_worker_requests(s, previous)
        return _ChunkWork(
            chunk.job_id,
            list(chunk.request_ids),
            job.target,
            job.drafter,
            job.batch_size,
            measure=chunk.measure_baseline and lifecycle.wants_baseline(job),
            cancelling=lifecycle.is_stopping(job.status),
            precision={k: v for k, v in (("weights", job.weights), ("dtype", job.dtype)) if v is not None},
        )


def _process(rt: Runtime, chunk_id: str, token: str) -> dict[str, Any]:
    out: dict[str, Any] = {"chunk": chunk_id, "worker": token}
    work = _claim(rt, chunk_id, token)
    if isinstance(work, str):
        return {**out, "skipped": work}
    holding = rt.heartbeat.hold(token, chunk_id)
    counted = metrics.ChunkMetrics(target=work.target, drafter=work.drafter, n=len(work.request_ids))
    try:
        if work.cancelling:
            lifecycle.after_run(rt.session_factory, work.job_id, RunOutcome.CANCELLED)
            with rt.session_factory.begin() as s:
                chunks.finish_chunk(s, chunk_id, token)
            return {**out, "stopped": STOPPED_CANCELLED}
        try:
            decoder = rt.decoder(work.target, work.drafter, **work.precision)
        except SpecBatchError as exc:  # bad input (unknown model...): these requests fail, no retry
            _fail_unloadable(rt, work, chunk_id, token, exc, counted)
            return {**out, "failed": "model_error"}
        if work.measure:
            _measure(rt, work, decoder, holding, counted)
        return _run_chunk(rt, work, decoder, chunk_id, holding, counted, out)
    finally:
        counted.close()
        rt.heartbeat.drop(token)


def _fail_unloadable(
    rt: Runtime, work: _ChunkWork, chunk_id: str, token: str, exc: Exception, counted: metrics.ChunkMetrics
) -> None:
    msg = f"the worker could not load target {work.target!r} with drafter {work.drafter!r}: {exc}"
    with rt.session_factory.begin() as s:
        failed = sum(
            queries.save_failure(s, rid, "model_error", msg, worker=token)
            for rid in chunks.open_ids_of(s, work.request_ids)
        )
        chunks.finish_chunk(s, chunk_id, token)
    for _ in range(failed):
        counted.on_stored(REQ_FAILED, None)
    lifecycle.after_run(rt.session_factory, work.job_id, RunOutcome.FINISHED)  # every request it had is done


def _measure(
    rt: Runtime, work: _ChunkWork, decoder: DecoderLike, holding: lease.Lease, counted: metrics.ChunkMetrics
) -> None:
    try:
        measure_baseline(rt.session_factory, work.job_id, decoder, lease=holding, on_stored=counted.on_stored)
    except Exception as exc:
        if is_transient(exc):
            raise
        log.warning("job %s: baseline measurement failed: %s", work.job_id, exc)


def _run_chunk(
    rt: Runtime,
    work: _ChunkWork,
    decoder: DecoderLike,
    chunk_id: str,
    holding: lease.Lease,
    counted: metrics.ChunkMetrics,
    out: dict[str, Any],
) -> dict[str, Any]:
    # The runner stops at the next decoding step when the job is being cancelled, or (should_stop) when
    # another worker took the chunk over; rows it did not finish go back to pending. It reports how it ended to
    # lifecycle.after_run (the job settled or completed there); what is left here is the chunk's own state.
    # A job already partly done (by others too) warms this worker's memory of it from SQL on first use.
    session_factory, job_id = rt.session_factory, work.job_id
    memory = rt.memories.get(session_factory, job_id, decoder.tokenizer) if uses_job_memory(decoder) else None
    report = run_requests(
        session_factory,
        job_id,
        decoder,
        request_ids=work.request_ids,
        batch_size=work.batch_size,
        lease=holding,  # the heartbeat renews it
        should_stop=lambda: holding.lost,
        on_stored=counted.on_stored,
        finalize=True,
        memory=memory,
    )
    stopped = TAKEN_OVER if report.stopped == STOPPED_BY_CALLER else report.stopped
    out.update(
        completed=report.completed,
        failed=report.failed,
        skipped=report.skipped,
        output_tokens=report.output_tokens,
        finalized=report.finalized,
    )
    with session_factory.begin() as s:
        status = queries.get_job(s, job_id).status
        open_ids = chunks.open_ids_of(s, work.request_ids)
        if lifecycle.is_stopping(status):  # cancelled, or cancelling until its last runner stops
            chunks.finish_chunk(s, chunk_id, holding.token)
            stopped = STOPPED_CANCELLED
        elif holding.lost:
            pass  # another worker holds the chunk now
        elif open_ids and not lifecycle.is_terminal(status):
            chunks.expire_chunk(s, chunk_id, holding.token)  # someone else's claim, or released: re-queue
            rt.heartbeat.poke()
        else:
            chunks.finish_chunk(s, chunk_id, holding.token)
    if report.finalized or lifecycle.is_terminal(status) or stopped == STOPPED_CANCELLED:
        rt.memories.drop(job_id)  # the job ended
    out["stopped"] = stopped
    return out


__all__ = ["Runtime", "process_chunk", "runtime"]
