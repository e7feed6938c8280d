"""The queue side of the store: one row per chunk of a job's requests published to Celery (``queue_chunks``).

The requests table says what is done; this table says which messages should exist and who holds them, so that
no request is lost when a worker, its pool child, Redis or the database goes away:

- ``state``: ``queued`` (a message for it should be in the broker), ``running`` (a worker holds it, ``worker``
  and ``lease_expires_at`` renewed by a heartbeat), ``done`` (every request of it finished or the job ended),
  ``split`` (replaced by one chunk per open request after its worker was lost twice: a request that kills its
  worker then fails alone).
- ``epoch``: the broker epoch (a random value kept in Redis, see workers/reaper.py) the message was last
  published in; NULL = never published (a submit that died before publishing). A Redis restart without
  persistence (or a flush) loses every queued message; a new epoch makes the reaper publish them again.

Every function takes a caller-owned Session and none commits. The racing updates (claim, renew, requeue,
finish) are single conditional UPDATE statements: at most one racer changes a row.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import and_, delete, exists, func, or_, select, update
from sqlalchemy.orm import Session

from . import request_claims
from .models import (
    CHUNK_DONE,
    CHUNK_LIVE,
    CHUNK_QUEUED,
    CHUNK_RUNNING,
    CHUNK_SPLIT,
    CHUNK_STATES,
    JOB_CANCELLING,
    JOB_IN_PROGRESS,
    JOB_VALIDATING,
    REQUEST_OPEN,
    Job,
    QueueChunk,
    Request,
    utcnow,
)

# Jobs whose chunks still need running (a cancelling job's chunks run only to cancel their requests).
JOB_ACTIVE = (JOB_VALIDATING, JOB_IN_PROGRESS, JOB_CANCELLING)


def new_chunk_id() -> str:
    return str(uuid.uuid4())


def add_chunks(
    session: Session,
    job_id: str,
    queue: str,
    ids: Sequence[int],
    chunk_size: int,
    *,
    measure_baseline: bool = False,
    epoch: str | None = None,
    attempts: int = 0,
) -> list[QueueChunk]:
    """Splits `ids` (in order) into chunks of `chunk_size`, numbered after the job's existing chunks; the first
    one measures the job's baseline. `epoch`: the chunks are published in it by the caller before it commits."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunks = []
    now = utcnow()
    first_seq = next_seq(session, job_id)
    for n, start in enumerate(range(0, len(ids), chunk_size)):
        chunk = QueueChunk(
            id=new_chunk_id(),
            job_id=job_id,
            seq=first_seq + n,
            queue=queue,
            request_ids=[int(i) for i in ids[start : start + chunk_size]],
            measure_baseline=measure_baseline and n == 0,
            state=CHUNK_QUEUED,
            created_at=now,
            epoch=epoch,
            published_at=now if epoch is not None else None,
            attempts=attempts,
        )
        session.add(chunk)
        chunks.append(chunk)
    session.flush()
    return chunks


def next_seq(session: Session, job_id: str) -> int:
    """The seq of the job's next chunk (0 for its first)."""
    top = session.scalar(select(func.max(QueueChunk.seq)).where(QueueChunk.job_id == job_id))
    return 0 if top is None else top + 1


def get_chunk(session: Session, chunk_id: str) -> QueueChunk | None:
    return session.get(QueueChunk, chunk_id)


def job_chunks(session: Session, job_id: str, states: Iterable[str] | None = None) -> list[QueueChunk]:
    q = select(QueueChunk).where(QueueChunk.job_id == job_id)
    if states is not None:
        q = q.where(QueueChunk.state.in_(tuple(states)))
    return list(session.scalars(q.order_by(QueueChunk.seq)))


def mark_published(session: Session, chunk_ids: Sequence[str], epoch: str, *, now: datetime | None = None) -> int:
    """Records that queued chunks were published in `epoch` (running/done ones are left alone)."""
    if not chunk_ids:
        return 0
    res = session.execute(
        update(QueueChunk)
        .where(QueueChunk.id.in_(list(chunk_ids)), QueueChunk.state == CHUNK_QUEUED)
        .values(epoch=epoch, published_at=now or utcnow())
        .execution_options(synchronize_session=False)
    )
    return res.rowcount


def claim_chunk(
    session: Session,
    chunk_id: str,
    worker: str,
    lease_seconds: float,
    *,
    now: datetime | None = None,
    take_from: str | None = None,
) -> bool:
    """queued (or running with an expired lease, or running for `take_from`: a holder known to be dead)
    -> running for `worker`. True when this call got it."""
    now = now or utcnow()
    takeable = [
        QueueChunk.state == CHUNK_QUEUED,
        and_(
            QueueChunk.state == CHUNK_RUNNING,
            or_(QueueChunk.lease_expires_at.is_(None), QueueChunk.lease_expires_at < now),
        ),
    ]
    if take_from is not None:
        takeable.append(and_(QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker == take_from))
    res = session.execute(
        update(QueueChunk)
        .where(QueueChunk.id == chunk_id, or_(*takeable))
        .values(
            state=CHUNK_RUNNING,
            worker=worker,
            attempts=QueueChunk.attempts + 1,
            started_at=now,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
        )
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


def renew(session: Session, worker: str, lease_seconds: float, *, now: datetime | None = None) -> tuple[int, int]:
    """Heartbeat: extends the leases of `worker`'s running chunk(s) and requests. Returns (chunks, requests)
    renewed; 0 chunks means the chunk was taken over (its holder is then told to stop)."""
    now = now or utcnow()
    until = now + timedelta(seconds=lease_seconds)
    c = session.execute(
        update(QueueChunk)
        .where(QueueChunk.worker == worker, QueueChunk.state == CHUNK_RUNNING)
        .values(lease_expires_at=until)
        .execution_options(synchronize_session=False)
    ).rowcount
    return c, request_claims.renew_holder(session, worker, lease_seconds, now=now)


def finish_chunk(session: Session, chunk_id: str, worker: str | None, *, now: datetime | None = None) -> bool:
    """running (for `worker`; any holder when None) or queued -> done."""
    cond = [QueueChunk.id == chunk_id]
    if worker is not None:
        cond.append(and_(QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker == worker))
    else:
        cond.append(QueueChunk.state.in_((CHUNK_QUEUED, CHUNK_RUNNING)))
    res = session.execute(
        update(QueueChunk)
        .where(*cond)
        .values(state=CHUNK_DONE, finished_at=now or utcnow(), lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


def expire_chunk(session: Session, chunk_id: str, worker: str, *, now: datetime | None = None) -> bool:
    """The holder gives its chunk up without finishing it: its lease ends now, so the next reaper pass
    re-queues it (used when requests of it are still open after the runner returned)."""
    res = session.execute(
        update(QueueChunk)
        .where(QueueChunk.id == chunk_id, QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker == worker)
        .values(lease_expires_at=now or utcnow())
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1


def requeue_chunk(
    session: Session, chunk: QueueChunk, epoch: str | None, *, expected_worker: str | None, now: datetime | None = None
) -> bool:
    """running (held by `expected_worker`, presumed dead) or queued -> queued in `epoch`, and that holder's
    running requests -> pending (so the next holder can claim them at once). The caller publishes the chunk
    before committing. True when this call re-queued it."""
    now = now or utcnow()
    cond = [QueueChunk.id == chunk.id]
    if expected_worker is not None:
        cond += [QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker == expected_worker]
    else:
        cond += [QueueChunk.state == CHUNK_QUEUED]
    res = session.execute(
        update(QueueChunk)
        .where(*cond)
        .values(state=CHUNK_QUEUED, worker=None, lease_expires_at=None, epoch=epoch, published_at=now)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:
        return False
    if expected_worker is not None:
        release_worker_requests(session, expected_worker)
    return True


def release_worker_requests(session: Session, worker: str) -> int:
    """A lost holder's running requests -> pending, each counting an attempt (its results, if it is in fact alive,
    still count once)."""
    return request_claims.release_holder(session, worker)


def split_chunk(
    session: Session, chunk: QueueChunk, open_ids: Sequence[int], epoch: str | None, *, expected_worker: str | None
) -> list[QueueChunk]:
    """Replaces a chunk whose holder was lost by one queued chunk per open request (state ``split``)."""
    cond = [QueueChunk.id == chunk.id]
    if expected_worker is not None:
        cond += [QueueChunk.state == CHUNK_RUNNING, QueueChunk.worker == expected_worker]
    else:
        cond += [QueueChunk.state == CHUNK_QUEUED]
    now = utcnow()
    res = session.execute(
        update(QueueChunk)
        .where(*cond)
        .values(state=CHUNK_SPLIT, finished_at=now, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:
        return []
    if expected_worker is not None:
        release_worker_requests(session, expected_worker)
    return add_chunks(
        session,
        chunk.job_id,
        chunk.queue,
        list(open_ids),
        1,
        measure_baseline=chunk.measure_baseline,
        epoch=epoch,
        attempts=chunk.attempts,
    )


def open_ids_of(session: Session, ids: Sequence[int]) -> list[int]:
    """Those of `ids` still pending or running, in the given order."""
    if not ids:
        return []
    open_ = set(session.scalars(select(Request.id).where(Request.id.in_(list(ids)), Request.status.in_(REQUEST_OPEN))))
    return [i for i in ids if i in open_]


def chunk_counts(session: Session, job_id: str) -> dict[str, int]:
    rows = session.execute(
        select(QueueChunk.state, func.count()).where(QueueChunk.job_id == job_id).group_by(QueueChunk.state)
    ).all()
    counts = {s: 0 for s in CHUNK_STATES}
    counts.update({s: n for s, n in rows})
    return counts


def orphan_request_ids(session: Session, job_id: str) -> list[int]:
    """Open requests of the job that no live (queued or running) chunk covers, in line order."""
    covered: set[int] = set()
    for ids in session.scalars(
        select(QueueChunk.request_ids).where(QueueChunk.job_id == job_id, QueueChunk.state.in_(CHUNK_LIVE))
    ):
        covered.update(int(i) for i in ids)
    open_ids = session.scalars(
        select(Request.id)
        .where(Request.job_id == job_id, Request.status.in_(REQUEST_OPEN))
        .order_by(Request.line_number)
    )
    return [i for i in open_ids if i not in covered]


def baseline_chunk_pending(session: Session, job_id: str) -> bool:
    """True when a live chunk of the job will measure its baseline."""
    return bool(
        session.scalar(
            select(
                exists().where(
                    QueueChunk.job_id == job_id, QueueChunk.measure_baseline.is_(True), QueueChunk.state.in_(CHUNK_LIVE)
                )
            )
        )
    )


def set_job_queue(session: Session, job_id: str, queue: str, chunk_size: int) -> None:
    """Gives a job that has none its queue and chunk size (a local job resumed on the queue keeps them)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.queue.is_(None))
        .values(queue=queue)
        .execution_options(synchronize_session=False)
    )
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.chunk_size.is_(None))
        .values(chunk_size=chunk_size)
        .execution_options(synchronize_session=False)
    )


def delete_unpublished_job(session: Session, job_id: str) -> bool:
    """Deletes a job none of whose chunks was ever published or started (one conditional DELETE)."""
    touched = exists().where(
        QueueChunk.job_id == job_id, or_(QueueChunk.epoch.is_not(None), QueueChunk.state != CHUNK_QUEUED)
    )
    res = session.execute(delete(Job).where(Job.id == job_id, ~touched).execution_options(synchronize_session=False))
    return res.rowcount == 1


def running_chunk_holders(session: Session, job_id: str) -> list[tuple[str, datetime | None]]:
    """(worker, lease_expires_at) of the job's running chunks."""
    return [
        (w, t)
        for w, t in session.execute(
            select(QueueChunk.worker, QueueChunk.lease_expires_at).where(
                QueueChunk.job_id == job_id, QueueChunk.state == CHUNK_RUNNING
            )
        ).all()
    ]


def cancel_queued_chunks(session: Session, job_id: str) -> int:
    """A cancelled job's queued chunks -> done (their messages, if delivered, then do nothing)."""
    return session.execute(
        update(QueueChunk)
        .where(QueueChunk.job_id == job_id, QueueChunk.state == CHUNK_QUEUED)
        .values(state=CHUNK_DONE, finished_at=utcnow())
        .execution_options(synchronize_session=False)
    ).rowcount


__all__ = [
    "CHUNK_DONE",
    "CHUNK_LIVE",
    "CHUNK_QUEUED",
    "CHUNK_RUNNING",
    "CHUNK_SPLIT",
    "CHUNK_STATES",
    "JOB_ACTIVE",
    "QueueChunk",
    "add_chunks",
    "baseline_chunk_pending",
    "cancel_queued_chunks",
    "chunk_counts",
    "claim_chunk",
    "delete_unpublished_job",
    "expire_chunk",
    "finish_chunk",
    "get_chunk",
    "job_chunks",
    "mark_published",
    "new_chunk_id",
    "next_seq",
    "open_ids_of",
    "orphan_request_ids",
    "release_worker_requests",
    "renew",
    "requeue_chunk",
    "running_chunk_holders",
    "set_job_queue",
    "split_chunk",
]
