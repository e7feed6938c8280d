"""What the reaper looks for in the queue's tables: chunks whose holder vanished, messages the broker lost, requests
lost too often, queue jobs left unfinalized or cancelling, and queue jobs with requests no chunk covers
(spec_batch.workers.reaper). Every function takes a Session the caller owns; none commits, and the one update
(republish_claim) is conditional."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import and_, exists, or_, select, update
from sqlalchemy.orm import Session

from .chunks import JOB_ACTIVE
from .models import (
    CHUNK_QUEUED,
    CHUNK_RUNNING,
    JOB_CANCELLING,
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    REQ_RUNNING,
    REQUEST_OPEN,
    Job,
    QueueChunk,
    Request,
    utcnow,
)


def expired_chunks(session: Session, *, now: datetime | None = None, limit: int = 100) -> list[QueueChunk]:
    """Running chunks whose holder stopped renewing its lease."""
    now = now or utcnow()
    return list(
        session.scalars(
            select(QueueChunk)
            .where(QueueChunk.state == CHUNK_RUNNING, QueueChunk.lease_expires_at < now)
            .order_by(QueueChunk.lease_expires_at)
            .limit(limit)
        )
    )


def running_chunks_of(session: Session, worker_prefix: str, limit: int = 100) -> list[QueueChunk]:
    """Running chunks whose holder's token starts with `worker_prefix` (the same worker node)."""
    esc = worker_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return list(
        session.scalars(
            select(QueueChunk)
            .where(QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker.like(esc + "%", escape="\\"))
            .limit(limit)
        )
    )


def unpublished_chunks(session: Session, epoch: str, *, grace_before: datetime, limit: int = 500) -> list[QueueChunk]:
    """Queued chunks of active jobs whose message is not in the broker's current epoch: published in an
    earlier epoch (Redis lost its data), or never published and older than `grace_before` (a submit that
    failed or died after storing the job)."""
    return list(
        session.scalars(
            select(QueueChunk)
            .join(Job, Job.id == QueueChunk.job_id)
            .where(
                QueueChunk.state == CHUNK_QUEUED,
                Job.status.in_(JOB_ACTIVE),
                or_(
                    and_(QueueChunk.epoch.is_not(None), QueueChunk.epoch != epoch),
                    and_(QueueChunk.epoch.is_(None), QueueChunk.created_at < grace_before),
                ),
            )
            .order_by(QueueChunk.created_at, QueueChunk.seq)
            .limit(limit)
        )
    )


def republish_claim(session: Session, chunk_id: str, old_epoch: str | None, epoch: str) -> bool:
    """queued chunk in `old_epoch` -> `epoch` (one reaper wins; it then publishes before committing)."""
    cond = QueueChunk.epoch.is_(None) if old_epoch is None else QueueChunk.epoch == old_epoch
    res = session.execute(
        update(QueueChunk)
        .where(QueueChunk.id == chunk_id, QueueChunk.state == CHUNK_QUEUED, cond)
        .values(epoch=epoch, published_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


def requests_over_attempts(session: Session, ids: Sequence[int], max_attempts: int) -> list[int]:
    """Open requests among `ids` whose claims ended without a result `max_attempts` times (crashed or lost holders:
    request_claims.release_requests)."""
    if not ids:
        return []
    return list(
        session.scalars(
            select(Request.id).where(
                Request.id.in_(list(ids)), Request.status.in_(REQUEST_OPEN), Request.attempts >= max_attempts
            )
        )
    )


def jobs_to_adopt(session: Session, *, created_before: datetime, limit: int) -> list[str]:
    """In-progress queue jobs older than `created_before` (a submit may have died before storing chunks)."""
    return list(
        session.scalars(
            select(Job.id)
            .where(Job.queue.is_not(None), Job.status == JOB_IN_PROGRESS, Job.created_at < created_before)
            .order_by(Job.created_at)
            .limit(limit)
        )
    )


def running_chunks_held_by(session: Session, holders: Iterable[str]) -> list[QueueChunk]:
    holders = list(holders)
    if not holders:
        return []
    return list(
        session.scalars(select(QueueChunk).where(QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker.in_(holders)))
    )


def queue_jobs_to_finalize(session: Session, limit: int = 50) -> list[str]:
    """In-progress queue jobs with nothing open any more (their last worker died before finalizing)."""
    open_req = exists().where(Request.job_id == Job.id, Request.status.in_(REQUEST_OPEN))
    return list(
        session.scalars(
            select(Job.id).where(Job.queue.is_not(None), Job.status == JOB_IN_PROGRESS, ~open_req).limit(limit)
        )
    )


def queue_jobs_to_cancel(session: Session, limit: int = 50) -> list[str]:
    """Cancelling queue jobs with no request running any more."""
    running_req = exists().where(Request.job_id == Job.id, Request.status == REQ_RUNNING)
    return list(
        session.scalars(
            select(Job.id).where(Job.queue.is_not(None), Job.status == JOB_CANCELLING, ~running_req).limit(limit)
        )
    )


def queue_jobs_stuck_finalizing(session: Session, *, since_before: datetime, limit: int = 50) -> list[str]:
    """Queue jobs finalizing since before `since_before` (the worker finalizing them died in between)."""
    return list(
        session.scalars(
            select(Job.id)
            .where(Job.queue.is_not(None), Job.status == JOB_FINALIZING, Job.finalizing_at < since_before)
            .limit(limit)
        )
    )


__all__ = [
    "expired_chunks",
    "jobs_to_adopt",
    "queue_jobs_stuck_finalizing",
    "queue_jobs_to_cancel",
    "queue_jobs_to_finalize",
    "republish_claim",
    "requests_over_attempts",
    "running_chunks_held_by",
    "running_chunks_of",
    "unpublished_chunks",
]
