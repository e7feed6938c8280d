"""A job's statistics from its stored rows, with the core's one definition of each rate.

The rates (acceptance rate, tokens per step, tokens/s) are defined once, as RequestStats' properties
(spec_batch.core.outputs). A set of requests has the rates of its summed statistics, with the job's decode time
as wall time (requests of one batch overlap, so their own wall times are not summed). The ``job_summary`` view
computes the same in SQL; tests/store/test_rates.py checks that the two agree on a real job.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.outputs import RequestStats
from ..store import summaries


def stats_of_row(row: Any) -> RequestStats:
    """A stored request's statistics (NULL counts as 0)."""
    return RequestStats(
        prompt_tokens=row.prompt_tokens or 0,
        output_tokens=row.output_tokens or 0,
        draft_tokens=row.draft_tokens or 0,
        accepted_tokens=row.accepted_tokens or 0,
        target_forwards=row.target_forwards or 0,
        draft_forwards=row.draft_forwards or 0,
        forced_tokens=row.forced_tokens or 0,
        accepted_length_histogram=list(row.accepted_length_histogram or []),
        wall_s=row.wall_s or 0.0,
    )


def pooled(
    *, output_tokens: int, draft_tokens: int, accepted_tokens: int, target_forwards: int, wall_s: float = 0.0
) -> RequestStats:
    """The statistics of a set of requests: their sums, over `wall_s` seconds of decoding."""
    return RequestStats(
        output_tokens=output_tokens,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted_tokens,
        target_forwards=target_forwards,
        wall_s=wall_s,
    )


def rates(stats: RequestStats) -> dict[str, float | None]:
    return {
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_step": stats.tokens_per_step,
        "tokens_per_s": stats.tokens_per_s,
    }


def stats_by_model(session_factory: sessionmaker[Session]) -> list[dict[str, Any]]:
    """Per (target, drafter) over every job: counts, pooled acceptance rate and tokens per step, and the mean
    tokens/s and measured speedups of its jobs."""
    with session_factory() as s:
        rows = summaries.model_totals(s)
    for r in rows:
        total = pooled(
            output_tokens=r["output_tokens"],
            draft_tokens=r["draft_tokens"],
            accepted_tokens=r["accepted_tokens"],
            target_forwards=r["target_forwards"],
        )
        r["acceptance_rate"] = total.acceptance_rate
        r["tokens_per_step"] = total.tokens_per_step
    return rows


__all__ = ["pooled", "rates", "stats_by_model", "stats_of_row"]
