"""The baseline sample, request by request (``baseline_samples``, migration 0004).

A job measures its speedup on a sample of its requests, decoded twice with the same engine and batch size:
with speculation and without (``spec_batch.jobs.service.measure_baseline``). The job row keeps the totals
(``jobs.baseline_*``, ``jobs.sample_*``: the speedup of ``job_summary``); this table keeps each sampled
request's pair, so a report can show which requests sped up and which did not.

Per-request wall time is the request's own time inside the batch (admission to finish), so the two sides of a
row are comparable with each other, not with the job's aggregate tokens/s.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sqlalchemy import Float, ForeignKey, Integer, insert
from sqlalchemy.orm import Mapped, Session, mapped_column

from .models import Base


class BaselineSample(Base):
    """One sampled request of a job's baseline: its tokens and seconds with and without speculation."""

    __tablename__ = "baseline_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), unique=True)
    speculative_output_tokens: Mapped[int] = mapped_column(Integer)
    speculative_target_forwards: Mapped[int] = mapped_column(Integer)
    speculative_wall_s: Mapped[float] = mapped_column(Float)
    baseline_output_tokens: Mapped[int] = mapped_column(Integer)  # without speculation: one token per step
    baseline_wall_s: Mapped[float] = mapped_column(Float)

    def __repr__(self) -> str:
        return f"BaselineSample(job_id={self.job_id!r}, request_id={self.request_id!r})"


@dataclass(frozen=True)
class SamplePair:
    """What one sampled request measured, as written by measure_baseline."""

    request_id: int
    speculative_output_tokens: int
    speculative_target_forwards: int
    speculative_wall_s: float
    baseline_output_tokens: int
    baseline_wall_s: float


def record_baseline_samples(session: Session, job_id: str, pairs: Sequence[SamplePair]) -> None:
    """Inserts the job's per-request baseline pairs. Call it in the transaction whose ``record_baseline``
    returned True (the first measurement wins, so the pairs are written once)."""
    if pairs:
        session.execute(
            insert(BaselineSample),
            [{"job_id": job_id, **asdict(p)} for p in pairs],
        )
