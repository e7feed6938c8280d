"""Report data for the report tests, made without a model: a job whose requests accept drafts at different
rates (some pay, some do not), with a baseline sample, and job_summary-like history rows."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from spec_batch.store.report_queries import BaselinePoint, JobReportData, RequestPoint

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
K = 4  # draft tokens per step


def sample_job(job_id: str = "job_sample", n: int = 48, seed: int = 0, baseline_every: int = 6) -> JobReportData:
    """n requests in batches of 8; request i accepts each draft position with probability alpha_i."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        alpha = (0.15, 0.5, 0.8, 0.95)[i % 4]
        steps = 10 + (i * 7) % 30
        drafted, accepted, hist = [0] * K, [0] * K, [0] * (K + 1)
        for _ in range(steps):
            run = 0
            while run < K and rng.random() < alpha:
                run += 1
            for j in range(K):
                drafted[j] += 1
                accepted[j] += j < run
            hist[run] += 1
        out = steps + sum(accepted)
        wall = steps * 0.03
        start = T0 + timedelta(seconds=(i // 8) * 2.0)
        requests.append(
            RequestPoint(
                request_id=i + 1,
                custom_id=f"req-{i:03d}",
                line_number=i + 1,
                status="completed",
                output_tokens=out,
                draft_tokens=K * steps,
                accepted_tokens=sum(accepted),
                target_forwards=steps,
                accepted_length_histogram=hist,
                drafted_per_position=drafted,
                accepted_per_position=accepted,
                wall_s=wall,
                started_at=start,
                completed_at=start + timedelta(seconds=wall),
            )
        )
    baseline = [
        BaselinePoint(
            r.request_id,
            r.custom_id,
            r.line_number,
            r.output_tokens or 0,
            r.target_forwards or 0,
            r.wall_s or 0.0,
            r.output_tokens or 0,
            (r.output_tokens or 0) * 0.02,
        )
        for r in requests[::baseline_every]
    ]
    tokens = sum(r.output_tokens or 0 for r in requests)
    summary = {
        "job_id": job_id,
        "status": "completed",
        "target": "default",
        "drafter": "ngram",
        "n_requests": n,
        "n_completed": n,
        "n_failed": 0,
        "output_tokens": tokens,
        "acceptance_rate": sum(r.accepted_tokens or 0 for r in requests) / sum(r.draft_tokens or 0 for r in requests),
        "tokens_per_step": tokens / sum(r.target_forwards or 0 for r in requests),
        "tokens_per_s": tokens / 12.0,
        "baseline_tokens_per_s": 50.0,
        "speedup": 1.6,
        "created_at": T0,
        "completed_at": T0 + timedelta(seconds=14),
        "forced_tokens": 0,
    }
    return JobReportData(
        job_id=job_id,
        summary=summary,
        batch_size=8,
        baseline_sample=len(baseline),
        baseline_requests=len(baseline),
        decode_wall_s=12.0,
        started_at=T0,
        error=None,
        requests=requests,
        baseline=baseline,
    )


def empty_job(job_id: str = "job_empty") -> JobReportData:
    """A job nothing of which has run yet (every chart has nothing to draw)."""
    summary = {
        "job_id": job_id,
        "status": "in_progress",
        "target": "default",
        "drafter": "ngram",
        "n_requests": 2,
        "n_completed": 0,
        "n_failed": 0,
        "output_tokens": 0,
        "acceptance_rate": None,
        "tokens_per_step": None,
        "tokens_per_s": None,
        "baseline_tokens_per_s": None,
        "speedup": None,
        "created_at": T0,
        "completed_at": None,
        "forced_tokens": 0,
    }
    requests = [RequestPoint(i, f"r{i}", i, "pending", *([None] * 10)) for i in (1, 2)]
    return JobReportData(job_id, summary, 8, 8, None, 0.0, None, None, requests, [])


def history_rows() -> list[dict]:
    """job_summary rows of 10 jobs over 5 days, two target/drafter pairs, oldest first."""
    rows = []
    for day in range(5):
        for hour, (target, drafter, speedup) in ((3, ("default", "ngram", 1.3)), (5, ("default", "suffix", 1.7))):
            rows.append(
                {
                    "job_id": f"job_{day}_{drafter}",
                    "status": "completed",
                    "target": target,
                    "drafter": drafter,
                    "n_requests": 100,
                    "n_completed": 100,
                    "n_failed": 0,
                    "output_tokens": 5000,
                    "acceptance_rate": 0.6,
                    "tokens_per_step": 2.1,
                    "tokens_per_s": 180.0 + 10 * day,
                    "baseline_tokens_per_s": 110.0,
                    "speedup": speedup + 0.05 * day,
                    "created_at": T0 + timedelta(days=day, hours=hour),
                    "completed_at": None,
                    "forced_tokens": 0,
                }
            )
    return rows
