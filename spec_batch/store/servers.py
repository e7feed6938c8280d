"""Running servers (``servers``, migration 0011_servers): one row per `spec-batch serve` whose local batch runner
is up, with the target, drafter, weights and dtype it runs batches for and when it was last seen. A batch object
says when no live row can run its batch (issue 38: servers that share a database run only their own kind), rather
than waiting silently. Rows are written by the runner (store.servers.heartbeat), deleted when it stops; a server
killed leaves a row that stops counting after LIVE_S and is deleted after a day by any heartbeat.
"""

from __future__ import annotations

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
    row = session.get(RunningServer, server_id)
    if row is None:
        session.add(
            RunningServer(
                id=server_id, target=target, drafter=drafter, weights=weights, dtype=dtype, started_at=now, seen_at=now
            )
        )
    else:
        row.seen_at = now
    session.execute(delete(RunningServer).where(RunningServer.seen_at < now - FORGET_AFTER))


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


__all__ = ["FORGET_AFTER", "HEARTBEAT_S", "LIVE_S", "RunningServer", "can_run", "heartbeat", "remove"]
