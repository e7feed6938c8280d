"""The server's housekeeping, a Service (start/stop) of ServerContext.services: a thread that, every
`interval_s` seconds, ends as `expired` the batches whose completion_window ended (jobs.service.expire_job: what
was done stays, the rest goes to the error file as batch_expired), fails the jobs still `validating` after
SPEC_BATCH_STALE_VALIDATING_S (left by a process that died while validating: issue 38; a restarted server validates
again its own kind's younger ones, server/batch_validation.py), and, when a retention is set
(SPEC_BATCH_RETENTION_DAYS), once an hour deletes the files and ended batches older than it (`prune`, also
`spec-batch db prune`). Every server of a database does it: each change is a conditional UPDATE or a DELETE, so
servers racing on it change a batch once.

The clock is given (`clock`, default the wall clock), so a test can move time forward without waiting a day.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.jobs import lifecycle
from spec_batch.jobs.service import expire_job
from spec_batch.server.batch_objects import COMPLETION_WINDOWS
from spec_batch.server.context import ServerContext
from spec_batch.store import files as file_sql
from spec_batch.store.models import utcnow

log = logging.getLogger("spec_batch.server.housekeeping")
INTERVAL_S = 30.0  # how often overdue batches are looked for
PRUNE_EVERY = timedelta(hours=1)


def expire_overdue(session_factory: sessionmaker[Session], now: datetime) -> list[str]:
    """Expires every batch whose completion_window ended by `now`; the ids it expired."""
    with session_factory() as s:
        overdue = file_sql.overdue_batches(s, COMPLETION_WINDOWS, now)
    return [batch_id for batch_id in overdue if expire_job(session_factory, batch_id, now=now)]


def fail_stale_validating(session_factory: sessionmaker[Session], max_age_s: float, now: datetime) -> list[str]:
    """Fails every job validating for more than max_age_s (only from validating: one that just started is not
    touched); the ids it failed."""
    with session_factory() as s:
        stale = file_sql.stale_validating_jobs(s, now - timedelta(seconds=max_age_s))
    error = (
        f"validation did not finish within {max_age_s:g} s (SPEC_BATCH_STALE_VALIDATING_S): the process validating "
        "the file stopped; create the batch (or run the file) again"
    )
    failed = []
    for job_id in stale:
        with session_factory.begin() as s:
            if lifecycle.fail_stale_validating(s, job_id, error, now=now):
                failed.append(job_id)
    return failed


def prune(session_factory: sessionmaker[Session], retention_days: float, now: datetime) -> file_sql.Pruned:
    """Deletes the uploaded files and the ended batches (with their jobs) created more than retention_days ago."""
    with session_factory.begin() as s:
        return file_sql.prune_before(s, now - timedelta(days=retention_days))


class Housekeeping:
    def __init__(
        self, ctx: ServerContext, *, interval_s: float = INTERVAL_S, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.ctx = ctx
        self.interval_s = interval_s
        self.clock = clock
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pruned_at: datetime | None = None

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="spec-batch-housekeeping", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.tick()
            except Exception as exc:  # the database may be away for a moment: try again next time
                log.warning("housekeeping failed: %s: %s", type(exc).__name__, exc)
            self._stopping.wait(self.interval_s)

    def tick(self) -> None:
        now = self.clock()
        for batch_id in expire_overdue(self.ctx.session_factory, now):
            log.info("batch %s expired: its completion_window ended", batch_id)
        for job_id in fail_stale_validating(self.ctx.session_factory, self.ctx.settings.stale_validating_s, now):
            log.warning("job %s failed: still validating after %d s", job_id, self.ctx.settings.stale_validating_s)
        days = self.ctx.settings.retention_days
        if days is not None and (self._pruned_at is None or now - self._pruned_at >= PRUNE_EVERY):
            pruned = prune(self.ctx.session_factory, days, now)
            self._pruned_at = now
            if pruned.files or pruned.batches:
                log.info("retention (%g days): deleted %d files and %d batches", days, pruned.files, pruned.batches)
