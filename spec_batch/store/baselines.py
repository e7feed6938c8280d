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

from sqlalchemy import insert
from sqlalchemy.orm import Session

from .models import BaselineSample


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
