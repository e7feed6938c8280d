"""Validation of the API's batches after POST /v1/batches returned (OpenAI's shape: the batch is `validating` at
once, then `in_progress`, or `failed` with `errors` naming the lines): a Service of ServerContext.services, one
thread fed by `submit(batch_id)`, that runs batch_create.validate_batch and hands a started batch to the batch
runner (`ctx.batches.submitted`).

A server that died mid-validation left its batch `validating` (the job and its batch row, no request rows: those
are written in the transaction that moves the job on). On start, this service validates again the `validating`
batches made for this server's kind (target, drafter, weights, dtype, queue) younger than
SPEC_BATCH_STALE_VALIDATING_S; older ones, and those of a kind no server restarts with, are failed by the
housekeeping's sweep (server/housekeeping.py) once they reach that age. Another live server may be validating one
of them too: the move out of `validating` is a conditional UPDATE in the transaction that writes the rows, so one
of the two wins and the other writes nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import timedelta

from spec_batch.server.batch_create import validate_batch
from spec_batch.server.context import ServerContext
from spec_batch.store import files as file_sql
from spec_batch.store.models import utcnow

log = logging.getLogger("spec_batch.server.batch_validation")
_STOP = ""  # put on the queue by stop(): no batch id is empty


class BatchValidator:
    """Validates the API's batches on one thread, in the order they were submitted (see the module docstring)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, batch_id: str) -> None:
        """Validates the batch (stored `validating` by batch_create.open_batch) soon, off the request's thread."""
        self._queue.put(batch_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spec-batch-validation", daemon=True)
        self._thread.start()
        for batch_id in self._left_validating():
            self.submit(batch_id)

    def stop(self) -> None:
        """Returns once the validation in flight is done; batches still queued stay `validating` (the next start
        validates them again)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        while not self._queue.empty():  # a later start() gets a fresh list from the database
            self._queue.get_nowait()

    def _left_validating(self) -> list[str]:
        """This server kind's batches still validating, younger than the sweep's age (see the module docstring)."""
        if self.ctx.batches is None:
            return []
        try:
            own = self.ctx.batches.job_fields()
            after = utcnow() - timedelta(seconds=self.ctx.settings.stale_validating_s)
            with self.ctx.session_factory() as s:
                return file_sql.validating_batches(
                    s,
                    target=own.target,
                    drafter=own.drafter,
                    weights=own.weights,
                    dtype=own.dtype,
                    queue=own.queue,
                    created_after=after,
                )
        except Exception as exc:  # the sweep still fails them once they are old enough
            log.warning("cannot list the batches left validating: %s", exc)
            return []

    def _loop(self) -> None:
        while (batch_id := self._queue.get()) != _STOP:
            try:
                self.validate(batch_id)
            except Exception:  # validate_batch failed the batch; the next one goes on
                log.exception("batch %s: validation failed", batch_id)

    def validate(self, batch_id: str) -> bool:
        """Validates one batch here and now; True when this call moved it on (then the runner is told)."""
        runner = self.ctx.batches
        if runner is None:
            return False
        settings = self.ctx.settings
        moved = validate_batch(
            self.ctx.session_factory,
            batch_id,
            runner.job_fields(),
            max_line_bytes=settings.max_line_bytes,
            max_lines=settings.api_max_file_lines,
        )
        if moved:
            runner.submitted(batch_id)
        return moved


def make_batch_validator(ctx: ServerContext) -> BatchValidator:
    """The validator of the API's batches, set as ctx.validator. The caller adds it to ctx.services after the batch
    runner (it hands batches to it, and stops before it)."""
    validator = BatchValidator(ctx)
    ctx.validator = validator
    return validator
