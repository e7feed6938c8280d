"""The reaper: how a chunk whose worker vanished gets run by another worker, and the broker epoch.

A worker process that starts a chunk claims it in SQL (``queue_chunks.state='running'``, ``worker`` = a token
naming this process, ``lease_expires_at = now + SPEC_BATCH_LEASE_SECONDS``); the runner claims the chunk's
requests the same way. The heartbeat thread of every worker process (spec_batch.jobs.lease.Heartbeat) renews
both leases every ``lease/3`` seconds (at most every 60 s). When a machine is lost or a process is killed, the
renewals stop.

The same thread runs the *reaper* on every tick (its ``on_tick``), in every worker process (busy or idle), so
any live worker recovers what a dead one left:

1. a running chunk whose lease expired (or whose holder is a dead process of this same machine, see
   spec_batch.jobs.lease: a killed pool child is noticed at once) goes back to ``queued`` and is published again; the dead holder's requests
   go back to ``pending``. A chunk lost a second time is split into one chunk per open request, and a
   request claimed ``SPEC_BATCH_MAX_ATTEMPTS`` times without finishing fails alone (``worker_lost``), so a
   request that kills its worker cannot stall the job;
2. a queued chunk whose message is not in the broker any more is published again. The broker *epoch* is a
   random value stored in Redis (``spec-batch:broker-epoch``); a Redis restart without persistence, or a
   flush, loses it together with every queued message, so a chunk published in an older epoch is republished.
   A chunk never published (a submit that failed or died after storing the job) is published after one lease;
3. a queue job with nothing open any more that is still ``in_progress`` (its last worker died between storing
   the last result and finalizing) is finalized, and a ``cancelling`` one with nothing running is cancelled.

The reaper reports what it found to ``lifecycle.after_run`` (a run that finished, or a holder that vanished) and
lets it decide what the job does; it reads a job's status only through lifecycle's predicates.

Every step is a conditional UPDATE, so reapers in many processes racing on one row change it once; a chunk is
re-published inside the transaction that re-queues it (commit after publish), so a reaper that dies in between
leaves the chunk to the next one. Messages are never trusted alone: a task re-reads the chunk and skips it
unless it can claim it, so a duplicate message (redelivery, republish) does nothing.

Clocks: leases compare timestamps written by different machines; keep them NTP-synchronised (skew well under
the lease). Lease time is the only wait: a chunk of a vanished worker is re-queued within ``lease + lease/3``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.jobs import lifecycle
from spec_batch.jobs.lease import abandoned_tokens, brief, forget_abandoned, holder_is_dead, holder_prefix
from spec_batch.jobs.lifecycle import RunOutcome
from spec_batch.store import chunk_recovery, chunks, queries
from spec_batch.store.models import utcnow

log = logging.getLogger("spec_batch.workers.reaper")

EPOCH_KEY = "spec-batch:broker-epoch"
STATIC_EPOCH = "static"  # a broker that is not Redis: no lost-message detection
WORKER_LOST = "worker_lost"


# ---------------------------------------------------------------- broker epoch

_redis_clients: dict[tuple[int, str], Any] = {}


def _redis_for(broker_url: str):
    import redis

    key = (os.getpid(), broker_url)  # a client is never shared across a fork
    client = _redis_clients.get(key)
    if client is None:
        client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
        _redis_clients.clear()
        _redis_clients[key] = client
    return client


def broker_epoch(broker_url: str) -> str:
    """The broker's current epoch; creates it in a fresh (or restarted, or flushed) Redis. Raises when the
    broker cannot be reached."""
    if not broker_url.startswith(("redis://", "rediss://", "unix://")):
        return STATIC_EPOCH
    client = _redis_for(broker_url)
    value = client.get(EPOCH_KEY)
    if value is None:
        client.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
        value = client.get(EPOCH_KEY)
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------- reaper

Publisher = Callable[[chunks.QueueChunk], None]


@dataclass
class ReapReport:
    requeued: int = 0
    split: int = 0
    republished: int = 0
    failed_requests: int = 0
    finalized: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)

    def any(self) -> bool:
        return bool(
            self.requeued or self.split or self.republished or self.failed_requests or self.finalized or self.cancelled
        )


def _give_up_message(attempts: int) -> str:
    return (
        f"gave up after {attempts} attempts: each time, the worker running this request was lost (killed, "
        f"out of memory, machine gone) or its chunk ran past SPEC_BATCH_TASK_SOFT_TIME_LIMIT; "
        f"raise SPEC_BATCH_MAX_ATTEMPTS to try more often"
    )


def _recover_chunk(
    session_factory: sessionmaker[Session],
    chunk_id: str,
    holder: str,
    epoch: str,
    publish: Publisher,
    max_attempts: int,
    report: ReapReport,
    finalize: Callable[[str], None],
) -> None:
    job_id = None
    ended: RunOutcome | None = None  # how the vanished holder's run ended, when this call ends it
    with session_factory.begin() as s:
        chunk = chunks.get_chunk(s, chunk_id)
        if chunk is None or chunk.state != chunks.CHUNK_RUNNING or chunk.worker != holder:
            return  # someone else got there first
        job = queries.find_job(s, chunk.job_id)
        job_id = chunk.job_id
        open_ids = chunks.open_ids_of(s, chunk.request_ids)
        if job is None or not lifecycle.takes_new_work(job.status):
            # Nothing to run any more: free the dead holder's requests; lifecycle lets a cancellation finish.
            chunks.release_worker_requests(s, holder)
            chunks.finish_chunk(s, chunk.id, holder)
            ended = RunOutcome.INTERRUPTED if job is not None else None
        else:
            ended = _requeue_or_end(s, chunk, holder, open_ids, epoch, publish, max_attempts, report)
    if ended is RunOutcome.INTERRUPTED:
        if lifecycle.after_run(session_factory, job_id, ended).cancelled:
            report.cancelled += 1
    elif ended is RunOutcome.FINISHED:
        finalize(job_id)


def _requeue_or_end(
    s: Session,
    chunk: chunks.QueueChunk,
    holder: str,
    open_ids: list[int],
    epoch: str,
    publish: Publisher,
    max_attempts: int,
    report: ReapReport,
) -> RunOutcome | None:
    """A lost chunk of a job that still runs: its requests over the attempt limit fail alone, the rest is
    re-queued (split per request after a second loss). FINISHED when nothing of it is left to run."""
    chunks.release_worker_requests(s, holder)  # the lost claims count their attempt now
    over = set(chunk_recovery.requests_over_attempts(s, open_ids, max_attempts))
    for rid in over:
        attempts = queries.request_attempts(s, rid) or max_attempts
        if queries.save_failure(s, rid, WORKER_LOST, _give_up_message(attempts)):
            report.failed_requests += 1
    open_ids = [i for i in open_ids if i not in over]
    if not open_ids:
        chunks.release_worker_requests(s, holder)
        chunks.finish_chunk(s, chunk.id, holder)
        return RunOutcome.FINISHED
    if chunk.attempts >= 2 and len(open_ids) > 1:
        pieces = chunks.split_chunk(s, chunk, open_ids, epoch, expected_worker=holder)
        for piece in pieces:
            publish(piece)
        report.split += 1
    elif chunks.requeue_chunk(s, chunk, epoch, expected_worker=holder):
        publish(chunk)
        report.requeued += 1
    return None


def reap(
    session_factory: sessionmaker[Session],
    *,
    broker_url: str,
    publish: Publisher,
    lease_seconds: float,
    max_attempts: int,
    finalize: Callable[[str], None],
) -> ReapReport:
    """One pass of the reaper (see the module docstring). Safe to run from many processes at once."""
    report = ReapReport()
    try:
        epoch = broker_epoch(broker_url)
    except Exception as exc:  # broker down: nothing can be published now; the next tick tries again
        report.errors.append(f"broker: {brief(exc)}")
        return report
    now = utcnow()
    grace = now - timedelta(seconds=lease_seconds)
    _recover_lost_chunks(session_factory, epoch, publish, max_attempts, finalize, report, now)
    _republish_lost_messages(session_factory, epoch, publish, report, grace)
    _end_queue_jobs(session_factory, finalize, report, grace)
    return report


def _recover_lost_chunks(
    session_factory: sessionmaker[Session],
    epoch: str,
    publish: Publisher,
    max_attempts: int,
    finalize: Callable[[str], None],
    report: ReapReport,
    now: datetime,
) -> None:
    """1. chunks of vanished holders: expired leases, dead processes of this machine, attempts given up here."""
    with session_factory.begin() as s:
        lost = [(c.id, c.worker) for c in chunk_recovery.expired_chunks(s, now=now)]
        lost += [
            (c.id, c.worker) for c in chunk_recovery.running_chunks_of(s, holder_prefix()) if holder_is_dead(c.worker)
        ]
        lost += [(c.id, c.worker) for c in chunk_recovery.running_chunks_held_by(s, abandoned_tokens())]
    seen: set[str] = set()
    for chunk_id, holder in lost:
        if chunk_id in seen or holder is None:
            continue
        seen.add(chunk_id)
        try:
            _recover_chunk(session_factory, chunk_id, holder, epoch, publish, max_attempts, report, finalize)
            forget_abandoned(holder)
        except Exception as exc:
            report.errors.append(f"chunk {chunk_id}: {brief(exc)}")


def _republish_lost_messages(
    session_factory: sessionmaker[Session], epoch: str, publish: Publisher, report: ReapReport, grace: datetime
) -> None:
    """2. queued chunks whose message the broker does not have (an older epoch, or never published)."""
    with session_factory.begin() as s:
        stale = [(c.id, c.epoch) for c in chunk_recovery.unpublished_chunks(s, epoch, grace_before=grace)]
    for chunk_id, old_epoch in stale:
        try:
            with session_factory.begin() as s:
                if chunk_recovery.republish_claim(s, chunk_id, old_epoch, epoch):
                    chunk = chunks.get_chunk(s, chunk_id)
                    publish(chunk)
                    report.republished += 1
        except Exception as exc:
            report.errors.append(f"republish {chunk_id}: {brief(exc)}")


def _end_queue_jobs(
    session_factory: sessionmaker[Session], finalize: Callable[[str], None], report: ReapReport, grace: datetime
) -> None:
    """3. queue jobs left unfinalized (or stuck finalizing), cancelling jobs with nothing running."""
    with session_factory.begin() as s:
        to_finalize = chunk_recovery.queue_jobs_to_finalize(s)
        to_cancel = chunk_recovery.queue_jobs_to_cancel(s)
        stuck = chunk_recovery.queue_jobs_stuck_finalizing(s, since_before=grace)
    for job_id in stuck:  # the worker finalizing it died between its two steps
        try:
            if lifecycle.finish_finalizing(session_factory, job_id):
                report.finalized += 1
        except Exception as exc:
            report.errors.append(f"complete {job_id}: {brief(exc)}")
    for job_id in to_finalize:
        try:
            finalize(job_id)
            report.finalized += 1
        except Exception as exc:
            report.errors.append(f"finalize {job_id}: {brief(exc)}")
    for job_id in to_cancel:
        try:
            if lifecycle.after_run(session_factory, job_id, RunOutcome.CANCELLED).cancelled:
                report.cancelled += 1
        except Exception as exc:
            report.errors.append(f"cancel {job_id}: {brief(exc)}")


def adopt_orphans(
    session_factory: sessionmaker[Session],
    *,
    grace_s: float,
    publish: Publisher,
    epoch: str,
    chunk_size: int,
    limit: int = 20,
) -> int:
    """Reaper step: chunks for open requests of in-progress queue jobs that no live chunk covers (a submit that
    died between storing the job and storing its chunks). Returns the number of chunks created."""
    with session_factory() as s:
        jobs = chunk_recovery.jobs_to_adopt(s, created_before=utcnow() - timedelta(seconds=grace_s), limit=limit)
    created = 0
    for job_id in jobs:
        with session_factory.begin() as s:
            job = queries.get_job(s, job_id)
            orphans = chunks.orphan_request_ids(s, job_id)
            if not orphans or not lifecycle.is_running(job.status) or job.queue is None:
                continue
            # Two reapers racing here may both adopt the same requests: the second chunk then only finds
            # them claimed or done and does nothing (claims are conditional), so this needs no lock.
            new = chunks.add_chunks(s, job_id, job.queue, orphans, job.chunk_size or chunk_size, epoch=epoch)
            for c in new:
                publish(c)  # before the commit: a reaper that dies in between leaves the job to the next one
            created += len(new)
    return created


__all__ = [
    "EPOCH_KEY",
    "WORKER_LOST",
    "ReapReport",
    "adopt_orphans",
    "broker_epoch",
    "reap",
]
