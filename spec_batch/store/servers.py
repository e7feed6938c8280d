"""What runs batches now, so that a batch object says when nothing running can run it rather than waiting silently.

- ``servers`` (migration 0011_servers): one row per `spec-batch serve` whose local batch runner is up, with the
  target, drafter, weights and dtype it runs batches for (servers that share a database run only their own kind).
- ``worker_queues`` (migration 0012_worker_queues): one row per (worker process, queue it consumes), for queued
  batches.

Rows are written by their process every HEARTBEAT_S and deleted when it stops; a process killed leaves rows that
stop counting after LIVE_S and are deleted after a day by any heartbeat.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import String, delete, exists, or_, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from .models import Base, Job, UTCDateTime

LIVE_S = 90.0  # a row not seen for this long is a server that died (runners write theirs every HEARTBEAT_S)
HEARTBEAT_S = 20.0
FORGET_AFTER = timedelta(days=1)


class RunningServer(Base):
    __tablename__ = "servers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # host:pid:random, new at each start
    target: Mapped[str] = mapped_column(String(512))
    drafter: Mapped[str] = mapped_column(String(512))
    weights: Mapped[str | None] = mapped_column(String(16))  # NULL: runs any (as local_batches_to_run)
    dtype: Mapped[str | None] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


def process_id() -> str:
    """A new id for this process's rows (host:pid:random), unique across restarts and machines."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{secrets.token_hex(4)}"


def heartbeat(
    session: Session,
    server_id: str,
    *,
    target: str,
    drafter: str,
    weights: str | None,
    dtype: str | None,
    now: datetime,
) -> None:
    """Writes (or refreshes) the server's row, and deletes rows of servers not seen for a day."""
    _seen(
        session,
        RunningServer,
        server_id,
        now,
        id=server_id,
        target=target,
        drafter=drafter,
        weights=weights,
        dtype=dtype,
    )
    session.execute(delete(RunningServer).where(RunningServer.seen_at < now - FORGET_AFTER))


def _seen(
    session: Session, kind: type[RunningServer] | type[WorkerQueue], key: object, now: datetime, **row: object
) -> None:
    """The row with this key seen now: its seen_at refreshed, or the row added."""
    found = session.get(kind, key)
    if found is None:
        session.add(kind(**row, started_at=now, seen_at=now))
    else:
        found.seen_at = now


def remove(session: Session, server_id: str) -> None:
    session.execute(delete(RunningServer).where(RunningServer.id == server_id))


def can_run(session: Session, job: Job, now: datetime) -> bool:
    """Whether a live server's runner takes this local job: the same target and drafter, its weights (a job's
    NULL weights are full) and dtype (a NULL on either side matches any): store.files.local_batches_to_run's rule."""
    s = RunningServer
    cond = [
        s.target == job.target,
        s.drafter == job.drafter,
        s.seen_at >= now - timedelta(seconds=LIVE_S),
        or_(s.weights.is_(None), s.weights == (job.weights or "full")),
    ]
    if job.dtype is not None:
        cond.append(or_(s.dtype.is_(None), s.dtype == job.dtype))
    return bool(session.scalar(select(exists().where(*cond))))


class WorkerQueue(Base):
    __tablename__ = "worker_queues"

    worker: Mapped[str] = mapped_column(String(64), primary_key=True)  # host:pid:random of a worker process
    queue: Mapped[str] = mapped_column(String(128), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


def worker_heartbeat(session: Session, worker: str, queues: Iterable[str], *, now: datetime) -> None:
    """Writes (or refreshes) the worker process's rows, one per queue it consumes, and deletes rows of workers not
    seen for a day."""
    for queue in dict.fromkeys(queues):
        _seen(session, WorkerQueue, (worker, queue), now, worker=worker, queue=queue)
    session.execute(delete(WorkerQueue).where(WorkerQueue.seen_at < now - FORGET_AFTER))


def remove_worker(session: Session, worker: str) -> None:
    session.execute(delete(WorkerQueue).where(WorkerQueue.worker == worker))


def queue_served(session: Session, queue: str, now: datetime) -> bool:
    """Whether a live worker process consumes this queue."""
    w = WorkerQueue
    return bool(session.scalar(select(exists().where(w.queue == queue, w.seen_at >= now - timedelta(seconds=LIVE_S)))))


__all__ = [
    "FORGET_AFTER",
    "HEARTBEAT_S",
    "LIVE_S",
    "RunningServer",
    "WorkerQueue",
    "can_run",
    "heartbeat",
    "process_id",
    "queue_served",
    "remove",
    "remove_worker",
    "worker_heartbeat",
]
