"""SQL of the Files and Batches API (tables in file_tables.py): files and their chunks, batches and their jobs.

Owner filters: ``owner=None`` means auth is off (every caller is the anonymous owner and sees everything);
otherwise a row is seen only by its owner, so another key's file or batch reads as missing (a 404, no leak).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, delete, or_, select, update
from sqlalchemy.orm import Session

from .file_tables import Batch, FileChunk, StoredFile
from .models import JOB_FINALIZING, JOB_IN_PROGRESS, JOB_TERMINAL, JOB_VALIDATING, Job


def _owned(q: Select, column: Any, owner: str | None) -> Select:
    return q if owner is None else q.where(column == owner)


def _page(
    session: Session, q: Select, model: Any, after: str | None, owner: str | None, *, ascending: bool = False
) -> Select:
    """Newest first (oldest first when `ascending`); `after` (an id of the same owner's list) continues after that
    row in that order (OpenAI's cursor)."""
    if after is not None:
        cursor = session.execute(
            _owned(select(model.created_at, model.id).where(model.id == after), model.owner, owner)
        ).first()
        if cursor is None:
            return q.where(False)
        at, ident = cursor
        if ascending:
            q = q.where(or_(model.created_at > at, and_(model.created_at == at, model.id > ident)))
        else:
            q = q.where(or_(model.created_at < at, and_(model.created_at == at, model.id < ident)))
    if ascending:
        return q.order_by(model.created_at.asc(), model.id.asc())
    return q.order_by(model.created_at.desc(), model.id.desc())


# ---------------------------------------------------------------- files


def insert_file(session: Session, **values: Any) -> None:
    session.add(StoredFile(**values))
    session.flush()


def add_chunk(session: Session, file_id: str, seq: int, data: bytes) -> None:
    session.execute(FileChunk.__table__.insert().values(file_id=file_id, seq=seq, data=data))


def get_file(session: Session, file_id: str, owner: str | None) -> StoredFile | None:
    return session.scalars(_owned(select(StoredFile).where(StoredFile.id == file_id), StoredFile.owner, owner)).first()


def list_files(
    session: Session,
    owner: str | None,
    *,
    after: str | None = None,
    limit: int | None = 20,
    purpose: str | None = None,
    ascending: bool = False,
) -> list[StoredFile]:
    q = _owned(select(StoredFile), StoredFile.owner, owner)
    if purpose is not None:
        q = q.where(StoredFile.purpose == purpose)
    return list(session.scalars(_page(session, q, StoredFile, after, owner, ascending=ascending).limit(limit)))


def iter_chunks(session: Session, file_id: str) -> Iterator[bytes]:
    """The file's content, one chunk per query: at most one chunk in memory at a time."""
    seq = 0
    while True:
        data = session.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
        if data is None:
            return
        yield bytes(data)
        seq += 1


def delete_file(session: Session, file_id: str, owner: str | None) -> bool:
    """Deletes the file and its chunks (batches made from it keep their requests). True when it existed."""
    if get_file(session, file_id, owner) is None:
        return False
    session.execute(delete(FileChunk).where(FileChunk.file_id == file_id))
    session.execute(delete(StoredFile).where(StoredFile.id == file_id))
    return True


# ---------------------------------------------------------------- batches (a batch is the job with its id)


def insert_batch(session: Session, **values: Any) -> None:
    session.add(Batch(**values))
    session.flush()


def get_batch(session: Session, batch_id: str, owner: str | None) -> tuple[Batch, Job] | None:
    q = _owned(select(Batch, Job).join(Job, Job.id == Batch.id).where(Batch.id == batch_id), Batch.owner, owner)
    row = session.execute(q).first()
    return (row[0], row[1]) if row is not None else None


def list_batches(
    session: Session, owner: str | None, *, after: str | None = None, limit: int = 20
) -> list[tuple[Batch, Job]]:
    q = _owned(select(Batch, Job).join(Job, Job.id == Batch.id), Batch.owner, owner)
    return [(b, j) for b, j in session.execute(_page(session, q, Batch, after, owner).limit(limit))]


def ended_batches(session: Session, owner: str | None) -> list[tuple[Batch, Job]]:
    """The owner's batches whose job ended (their result files exist)."""
    q = _owned(select(Batch, Job).join(Job, Job.id == Batch.id), Batch.owner, owner).where(Job.status.in_(JOB_TERMINAL))
    return [(b, j) for b, j in session.execute(q)]


def mark_cancelling(session: Session, batch_id: str, now: datetime) -> None:
    session.execute(update(Batch).where(Batch.id == batch_id, Batch.cancelling_at.is_(None)).values(cancelling_at=now))


def local_batches_to_run(
    session: Session,
    target: str | None = None,
    drafter: str | None = None,
    weights: str | None = None,
    dtype: str | None = None,
) -> list[str]:
    """Batches a server runs itself (their job has no queue) that are not finished, oldest first; given a server's
    target, drafter, weights and dtype, only the batches whose job was made for them (several servers may share
    one database: each runs its own kind). A job's NULL weights mean full; a NULL dtype matches any."""
    q = (
        select(Batch.id)
        .join(Job, Job.id == Batch.id)
        .where(Job.queue.is_(None), Job.status.in_((JOB_IN_PROGRESS, JOB_FINALIZING)))
        .order_by(Batch.created_at, Batch.id)
    )
    if target is not None:
        q = q.where(Job.target == target)
    if drafter is not None:
        q = q.where(Job.drafter == drafter)
    if weights is not None:
        q = q.where(or_(Job.weights == weights, Job.weights.is_(None)) if weights == "full" else Job.weights == weights)
    if dtype is not None:
        q = q.where(or_(Job.dtype == dtype, Job.dtype.is_(None)))
    return list(session.scalars(q))


def queued_batches_open(session: Session) -> list[str]:
    """Queue batches not finished (in_progress): their orphan requests are enqueued again when a server starts."""
    q = (
        select(Batch.id)
        .join(Job, Job.id == Batch.id)
        .where(Job.queue.is_not(None), Job.status == JOB_IN_PROGRESS)
        .order_by(Batch.created_at, Batch.id)
    )
    return list(session.scalars(q))


def overdue_batches(session: Session, windows: Mapping[str, timedelta], now: datetime) -> list[str]:
    """Batches still in progress whose completion_window (one of `windows`: its name -> its length) ended by
    `now`: oldest first."""
    ended = [
        and_(Batch.completion_window == name, Batch.created_at <= now - length) for name, length in windows.items()
    ]
    if not ended:
        return []
    q = (
        select(Batch.id)
        .join(Job, Job.id == Batch.id)
        .where(Job.status == JOB_IN_PROGRESS, or_(*ended))
        .order_by(Batch.created_at, Batch.id)
    )
    return list(session.scalars(q))


def stale_validating_jobs(session: Session, before: datetime) -> list[str]:
    """Jobs (of a batch or not) still validating that were created before `before`: a job leaves validating in the
    transaction that writes its requests, so a job seen validating for long is one whose process died."""
    q = select(Job.id).where(Job.status == JOB_VALIDATING, Job.created_at < before).order_by(Job.created_at, Job.id)
    return list(session.scalars(q))


def set_batch_errors(session: Session, batch_id: str, errors: list[dict[str, Any]]) -> None:
    """The batch's `errors` (its file failed validation)."""
    session.execute(update(Batch).where(Batch.id == batch_id).values(errors=errors))


def validating_batches(
    session: Session,
    *,
    target: str,
    drafter: str,
    weights: str | None,
    dtype: str | None,
    queue: str | None,
    created_after: datetime,
) -> list[str]:
    """Batches still validating that a server of this kind (the job's target, drafter, weights, dtype and queue)
    made after `created_after`, oldest first: what a restarted server validates again."""
    q = (
        select(Batch.id)
        .join(Job, Job.id == Batch.id)
        .where(
            Job.status == JOB_VALIDATING,
            Batch.created_at > created_after,
            Job.target == target,
            Job.drafter == drafter,
            Job.weights.is_(None) if weights is None else Job.weights == weights,
            Job.dtype.is_(None) if dtype is None else Job.dtype == dtype,
            Job.queue.is_(None) if queue is None else Job.queue == queue,
        )
        .order_by(Batch.created_at, Batch.id)
    )
    return list(session.scalars(q))


def mark_result_deleted(session: Session, batch_id: str, *, output: bool, now: datetime) -> bool:
    """Records that the batch's output (or errors) file was deleted; True the first time."""
    column = Batch.output_deleted_at if output else Batch.errors_deleted_at
    done = session.execute(
        update(Batch).where(Batch.id == batch_id, column.is_(None)).values({column.key: now})
    ).rowcount
    return bool(done)


@dataclass(frozen=True)
class Pruned:
    files: int
    batches: int


def prune_before(session: Session, cutoff: datetime) -> Pruned:
    """Retention: deletes the uploaded files created before `cutoff` (with their chunks) and the batches created
    before it whose job ended, with their jobs (requests, chunks and samples go by cascade). Jobs of `spec-batch
    run` and `submit` (no batch) are not touched."""
    old_files = list(session.scalars(select(StoredFile.id).where(StoredFile.created_at < cutoff)))
    if old_files:
        session.execute(delete(FileChunk).where(FileChunk.file_id.in_(old_files)))
        session.execute(delete(StoredFile).where(StoredFile.id.in_(old_files)))
    old_batches = list(
        session.scalars(
            select(Batch.id)
            .join(Job, Job.id == Batch.id)
            .where(Batch.created_at < cutoff, Job.status.in_(JOB_TERMINAL))
        )
    )
    if old_batches:
        session.execute(delete(Batch).where(Batch.id.in_(old_batches)))
        session.execute(delete(Job).where(Job.id.in_(old_batches)))
    return Pruned(len(old_files), len(old_batches))


__all__ = [
    "Pruned",
    "add_chunk",
    "delete_file",
    "ended_batches",
    "get_batch",
    "get_file",
    "insert_batch",
    "insert_file",
    "iter_chunks",
    "list_batches",
    "list_files",
    "local_batches_to_run",
    "mark_cancelling",
    "mark_result_deleted",
    "overdue_batches",
    "prune_before",
    "queued_batches_open",
    "set_batch_errors",
    "stale_validating_jobs",
    "validating_batches",
]
