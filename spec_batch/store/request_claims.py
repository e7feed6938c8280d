"""Claims and leases on requests: who holds a running request and until when (spec_batch.jobs.lease renews them).

A claim is one conditional UPDATE, so two processes never hold one request. `requests.attempts` counts the claims
that ended without a result because their holder crashed or lost its lease (docs/architecture.md): a takeover of
an expired claim, a dead holder released, or `release_requests(lost=True)`; a clean give-back counts nothing.
Every function takes a Session the caller owns; none commits."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import and_, case, func, or_, select, update
from sqlalchemy.orm import Session

from .models import REQ_PENDING, REQ_RUNNING, Request, utcnow


def claim_requests(
    session: Session,
    job_id: str,
    ids: Sequence[int],
    *,
    worker: str | None,
    lease_seconds: float,
    now: datetime | None = None,
) -> list[int]:
    """Marks the claimable ones of `ids` running for `worker` until now + lease_seconds; returns them.

    Claimable: pending, or running with an expired (or no) lease: that earlier claim ended without a result
    because its holder lost its lease, so it counts as an attempt (see release_requests).
    """
    if not ids:
        return []
    now = now or utcnow()
    claimable = or_(
        Request.status == REQ_PENDING,
        and_(Request.status == REQ_RUNNING, or_(Request.lease_expires_at.is_(None), Request.lease_expires_at < now)),
    )
    res = session.execute(
        update(Request)
        .where(Request.job_id == job_id, Request.id.in_(list(ids)), claimable)
        .values(
            status=REQ_RUNNING,
            worker=worker,
            attempts=case((Request.status == REQ_RUNNING, Request.attempts + 1), else_=Request.attempts),
            started_at=now,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
        )
        .returning(Request.id)
        .execution_options(synchronize_session=False)
    )
    claimed = set(res.scalars().all())
    return [i for i in ids if i in claimed]


def renew_holder(session: Session, worker: str, lease_seconds: float, *, now: datetime | None = None) -> int:
    """Heartbeat: extends the lease of every request still running for `worker`. Returns how many."""
    until = (now or utcnow()) + timedelta(seconds=lease_seconds)
    return session.execute(
        update(Request)
        .where(Request.worker == worker, Request.status == REQ_RUNNING)
        .values(lease_expires_at=until)
        .execution_options(synchronize_session=False)
    ).rowcount


def release_requests(session: Session, ids: Sequence[int], *, worker: str | None = None, lost: bool = False) -> int:
    """running -> pending for those of `ids` still running (for `worker`, when given). Returns how many.

    `attempts` counts the claims that ended without a result because a process crashed or lost its lease: `lost`
    says this one did (an error ended the attempt); a clean interruption (Ctrl-C, a stop, a cancel) does not."""
    if not ids:
        return 0
    cond = [Request.id.in_(list(ids)), Request.status == REQ_RUNNING]
    if worker is not None:
        cond.append(Request.worker == worker)
    attempts = Request.attempts + 1 if lost else Request.attempts
    res = session.execute(
        update(Request)
        .where(*cond)
        .values(status=REQ_PENDING, lease_expires_at=None, attempts=attempts)
        .execution_options(synchronize_session=False)
    )
    return res.rowcount


def release_holder(session: Session, worker: str, *, job_id: str | None = None) -> int:
    """Every request still running for `worker` (of `job_id`, when given) -> pending: its holder is gone (crashed,
    or its lease expired), so each counts an attempt (see release_requests)."""
    cond = [Request.worker == worker, Request.status == REQ_RUNNING]
    if job_id is not None:
        cond.append(Request.job_id == job_id)
    return session.execute(
        update(Request)
        .where(*cond)
        .values(status=REQ_PENDING, lease_expires_at=None, attempts=Request.attempts + 1)
        .execution_options(synchronize_session=False)
    ).rowcount


def request_holders(session: Session, job_id: str) -> list[tuple[str, int, datetime | None]]:
    """(worker, running requests, latest lease end) for each holder of the job's running requests."""
    rows = session.execute(
        select(Request.worker, func.count(), func.max(Request.lease_expires_at))
        .where(Request.job_id == job_id, Request.status == REQ_RUNNING)
        .group_by(Request.worker)
    ).all()
    return [(w or "", n, t) for w, n, t in rows]  # max() keeps the column's type: timezone-aware UTC


__all__ = [
    "claim_requests",
    "release_holder",
    "release_requests",
    "renew_holder",
    "request_holders",
]
