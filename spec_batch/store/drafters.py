"""Trained draft heads (``drafters``, migration 0009_drafters): one row per head, its facts and its weights.

A head is a few MB (safetensors), stored with its row so that a worker on another machine can load it by name
(spec_batch/jobs/heads.py writes it to a local cache directory; the loading layer reads only that directory).
Sessions are the caller's (``with factory.begin() as s:``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Integer, LargeBinary, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from .models import Base, JSONType, UTCDateTime, utcnow


class DraftHead(Base):
    __tablename__ = "drafters"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), default="head", server_default="head")
    target: Mapped[str] = mapped_column(String(512))  # the target's name as the decoder knows it
    source_jobs: Mapped[list[str]] = mapped_column(JSONType)
    tokens_trained: Mapped[int] = mapped_column(Integer)
    heldout_accepted_length: Mapped[float | None] = mapped_column(Float)  # accepted tokens per step, held out
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)  # config.json
    weights: Mapped[bytes] = mapped_column(LargeBinary)  # model.safetensors
    sha256: Mapped[str] = mapped_column(String(64))  # of the weights: the local cache's key
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


@dataclass(frozen=True)
class DrafterInfo:
    """A head's row without its weights (for list and show)."""

    name: str
    kind: str
    target: str
    source_jobs: list[str]
    tokens_trained: int
    heldout_accepted_length: float | None
    size_bytes: int
    sha256: str
    created_at: datetime
    config: dict[str, Any]


def save_drafter(session: Session, row: DraftHead) -> None:
    """Adds the head, replacing one of the same name (training again under a name replaces it)."""
    old = session.get(DraftHead, row.name)
    if old is not None:
        session.delete(old)
        session.flush()
    session.add(row)


def get_drafter(session: Session, name: str) -> DraftHead | None:
    return session.get(DraftHead, name)


def list_drafters(session: Session) -> list[DrafterInfo]:
    rows = session.execute(select(DraftHead).order_by(DraftHead.created_at, DraftHead.name)).scalars()
    return [drafter_info(r) for r in rows]


def drafter_info(r: DraftHead) -> DrafterInfo:
    return DrafterInfo(
        r.name,
        r.kind,
        r.target,
        list(r.source_jobs or []),
        r.tokens_trained,
        r.heldout_accepted_length,
        len(r.weights or b""),
        r.sha256,
        r.created_at,
        dict(r.config or {}),
    )


@dataclass(frozen=True)
class StoredOutput:
    """A completed request of a job, as training reads it: its input and the target's output."""

    job_id: str
    endpoint: str
    prompt: Any  # messages (chat) or prompt text
    output: str
    finish_reason: str | None


def job_targets(session: Session, job_ids: list[str]) -> dict[str, str]:
    """job id -> its target, for the jobs that exist."""
    from .models import Job

    return dict(session.execute(select(Job.id, Job.target).where(Job.id.in_(job_ids))).all())


def completed_outputs(session: Session, job_ids: list[str]) -> list[StoredOutput]:
    """Every completed request with an output of these jobs, in job then line order."""
    from .models import REQ_COMPLETED, Request

    rows = session.execute(
        select(Request.job_id, Request.endpoint, Request.prompt, Request.output, Request.finish_reason)
        .where(Request.job_id.in_(job_ids), Request.status == REQ_COMPLETED, Request.output.is_not(None))
        .order_by(Request.job_id, Request.line_number, Request.id)
    ).all()
    return [StoredOutput(j, e or "/v1/chat/completions", p, o, f) for j, e, p, o, f in rows]
