"""Where the API's batches run: `make_batch_runner(ctx)` returns the server's batch runner, a Service (start/stop)
that ServerContext.services starts with the app, and sets it as ``ctx.batches`` for the Batches API.

- ``local`` (SPEC_BATCH_API_RUNNER=local): a thread of the server process runs the batches, oldest first, on
  ``ctx.decoder`` (the engine's decoder-like object: `Decoder.generate`'s signature), through the job
  service (baseline, claims under a lease, finalization), so `spec-batch serve` works alone on SQLite. On start it
  resumes every unfinished local batch: requests of a server that died are taken over (its lease expired or its
  process is gone), so a restart mid-batch loses nothing. stop() hands the requests in flight back (pending).
- ``queue`` (SPEC_BATCH_API_RUNNER=queue): a batch is published to the Celery queue of the served pair
  (``ctx.served``), where the existing workers run it. stop() leaves batches with the queue; start()
  enqueues again the open requests of queue batches that no chunk covers (a server that died mid-enqueue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from spec_batch.core.decoder_like import DecoderLike
from spec_batch.core.outputs import GenerationResult
from spec_batch.jobs import lifecycle
from spec_batch.jobs.errors import RunStopped
from spec_batch.jobs.lifecycle import JobStateError
from spec_batch.jobs.service import resume_job
from spec_batch.server.batch_create import JobFields
from spec_batch.server.context import ServerContext
from spec_batch.server.errors import APIError
from spec_batch.store import files as file_sql
from spec_batch.store import queries, servers
from spec_batch.store.models import utcnow
from spec_batch.workers.enqueue import BrokerUnavailableError, check_broker, enqueue_job
from spec_batch.workers.routing import queue_name

log = logging.getLogger("spec_batch.server.batch_runner")
POLL_S = 2.0  # how often the local runner looks for batches when nothing woke it
MAX_FAILURES = 3  # unexpected errors of one batch before it is failed (not retried forever)


class BatchStopped(RunStopped):
    """Raised by _Stoppable before a decode when the runner stops or the batch is being cancelled: a RunStopped, so
    jobs.claims gives the claims back without counting an attempt (a clean interruption)."""


class _Stoppable:
    """The decoder as the runner hands it to the job service: before each generate call (the baseline's too, which
    takes no should_stop), it raises BatchStopped once `stopped()` says so; everything else is the decoder's."""

    def __init__(self, decoder: DecoderLike, stopped: Callable[[], bool]) -> None:
        self._decoder = decoder
        self._stopped = stopped

    def generate(self, *args: Any, **kwargs: Any) -> list[GenerationResult]:
        if self._stopped():
            raise BatchStopped()
        return self._decoder.generate(*args, **kwargs)

    def without_speculation(self) -> _Stoppable:
        return _Stoppable(self._decoder.without_speculation(), self._stopped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decoder, name)


def _decoder_limits(decoder: DecoderLike | None) -> dict[str, Any]:
    return {"max_context": getattr(decoder, "max_context", None), "vocab_size": getattr(decoder, "vocab_size", None)}


class LocalBatchRunner:
    """Runs the server's local batches on one thread (see the module docstring)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures: dict[str, int] = {}
        # Its row in `servers` (store/servers.py): batch objects say when no live server can run a batch.
        self.server_id = servers.process_id()
        self._beaten_at = 0.0

    def job_fields(self) -> JobFields:
        decoder, served = self.ctx.decoder, self.ctx.served
        precision = getattr(decoder, "precision", None)
        return JobFields(
            target=getattr(decoder, "target_name", None) or served.target,
            drafter=getattr(decoder, "draft_name", None) or served.drafter,
            weights=precision.target.weights if precision else getattr(served, "weights", None),
            dtype=precision.target.dtype_name if precision else getattr(served, "dtype", None),
            **_decoder_limits(decoder),
        )

    def check_ready(self) -> None:
        if self.ctx.decoder is None:
            raise APIError(503, "this server has no model to run batches with", code="service_unavailable")

    def submitted(self, batch_id: str) -> None:
        self._wake.set()

    def _heartbeat(self) -> None:
        """Writes this runner's row in `servers` at most every HEARTBEAT_S (never fails the loop)."""
        if time.monotonic() - self._beaten_at < servers.HEARTBEAT_S:
            return
        try:
            own = self.job_fields()
            with self.ctx.session_factory.begin() as s:
                fields = dict(target=own.target, drafter=own.drafter, weights=own.weights, dtype=own.dtype)
                servers.heartbeat(s, self.server_id, **fields, now=utcnow())
            self._beaten_at = time.monotonic()
        except Exception as exc:
            log.warning("cannot record this server in the database: %s", exc)

    def start(self) -> None:
        self._stopping.clear()
        self._beaten_at = 0.0
        self._heartbeat()  # before the first request: a batch object never says no server runs ours
        self._thread = threading.Thread(target=self._loop, name="spec-batch-batches", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Returns once the batch in flight has handed its requests back (they resume at the next start)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            with self.ctx.session_factory.begin() as s:
                servers.remove(s, self.server_id)
        except Exception as exc:  # it stops counting after servers.LIVE_S anyway
            log.warning("cannot remove this server from the database: %s", exc)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._heartbeat()
            try:
                own = self.job_fields()  # only batches made for this server's models and precision
                with self.ctx.session_factory() as s:
                    batch_ids = file_sql.local_batches_to_run(s, own.target, own.drafter, own.weights, own.dtype)
            except Exception as exc:
                log.warning("cannot list the batches to run: %s", exc)
                batch_ids = []
            for batch_id in batch_ids:
                if self._stopping.is_set():
                    return
                self._run_one(batch_id)
            self._wake.wait(POLL_S)

    def _stopped_or_cancelled(self, batch_id: str) -> bool:
        if self._stopping.is_set():
            return True
        with self.ctx.session_factory() as s:
            return lifecycle.is_stopping(queries.get_job(s, batch_id).status)

    def _run_one(self, batch_id: str) -> None:
        decoder = self.ctx.decoder
        stoppable = _Stoppable(decoder, lambda: self._stopped_or_cancelled(batch_id))
        try:
            resume_job(
                self.ctx.session_factory,
                batch_id,
                stoppable,
                should_stop=self._stopping.is_set,
                baseline=hasattr(decoder, "without_speculation"),
            )
        except BatchStopped:  # claims given back; a cancelled batch settles now (the runner did not get to it)
            lifecycle.after_run(self.ctx.session_factory, batch_id, lifecycle.RunOutcome.INTERRUPTED)
        except JobStateError as exc:  # another process holds it, or it was cancelled meanwhile: not ours now
            log.info("batch %s left alone: %s", batch_id, exc)
        except Exception as exc:
            self._failures[batch_id] = n = self._failures.get(batch_id, 0) + 1
            log.exception("batch %s: unexpected error (%d of %d)", batch_id, n, MAX_FAILURES)
            if n >= MAX_FAILURES:
                error = f"the batch failed in the server: {type(exc).__name__}: {exc}"
                lifecycle.after_run(self.ctx.session_factory, batch_id, lifecycle.RunOutcome.BROKEN, error=error)


class QueueBatchRunner:
    """Publishes batches to the Celery queue of the served pair (see the module docstring)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def job_fields(self) -> JobFields:
        served, settings = self.ctx.served, self.ctx.settings
        return JobFields(
            target=served.target,
            drafter=served.drafter,
            weights=served.weights,
            dtype=served.dtype,
            queue=queue_name(served.target, served.drafter, served.weights, served.dtype),
            chunk_size=settings.chunk_size,
            **_decoder_limits(self.ctx.decoder),
        )

    def check_ready(self) -> None:
        try:
            check_broker(self.ctx.settings.broker_url)
        except BrokerUnavailableError as exc:
            raise APIError(503, f"batches cannot be queued now: {exc}", code="service_unavailable") from None

    def submitted(self, batch_id: str) -> None:
        try:
            enqueue_job(self.ctx.session_factory, batch_id, broker_url=self.ctx.settings.broker_url)
        except BrokerUnavailableError as exc:  # the job is stored: the reaper or the next start publishes it
            log.warning("batch %s is stored but not fully enqueued yet: %s", batch_id, exc)

    def start(self) -> None:
        with self.ctx.session_factory() as s:
            open_ids = file_sql.queued_batches_open(s)
        for batch_id in open_ids:
            try:
                enqueue_job(
                    self.ctx.session_factory, batch_id, broker_url=self.ctx.settings.broker_url, republish_queued=False
                )
            except BrokerUnavailableError as exc:
                log.warning("batch %s: open requests not enqueued again: %s", batch_id, exc)
                return

    def stop(self) -> None:
        """Nothing to hand back: the batches stay with the queue and its workers."""


BatchRunner = LocalBatchRunner | QueueBatchRunner


def make_batch_runner(ctx: ServerContext) -> BatchRunner:
    """The runner SPEC_BATCH_API_RUNNER names (ctx.settings.api_runner), set as ctx.batches. The caller adds it to
    ctx.services (the app starts and stops it)."""
    runner: BatchRunner = QueueBatchRunner(ctx) if ctx.settings.api_runner == "queue" else LocalBatchRunner(ctx)
    ctx.batches = runner
    return runner
