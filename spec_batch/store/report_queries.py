"""Read-only queries behind ``spec-batch report``: plain dataclasses, no charts (``spec_batch.reports`` draws).

Every function takes a caller-owned Session. A job's request rows are read once, in line order, with only the
columns the report uses (no prompts or outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .baselines import BaselineSample
from .models import Request, job_summary
from .queries import get_job
from .summaries import job_summary_row


@dataclass(frozen=True)
class RequestPoint:
    """One request's statistics (None where the request has not run, e.g. an invalid line)."""

    request_id: int
    custom_id: str | None
    line_number: int
    status: str
    output_tokens: int | None
    draft_tokens: int | None
    accepted_tokens: int | None
    target_forwards: int | None
    accepted_length_histogram: list[int] | None
    drafted_per_position: list[int] | None
    accepted_per_position: list[int] | None
    wall_s: float | None
    started_at: datetime | None
    completed_at: datetime | None


@dataclass(frozen=True)
class BaselinePoint:
    """One request of the job's baseline sample: the same request decoded with and without speculation."""

    request_id: int
    custom_id: str | None
    line_number: int
    speculative_output_tokens: int
    speculative_target_forwards: int
    speculative_wall_s: float
    baseline_output_tokens: int
    baseline_wall_s: float


@dataclass(frozen=True)
class JobReportData:
    """Everything a job's report shows. ``summary`` is the job's ``job_summary`` row (a dict by column)."""

    job_id: str
    summary: dict[str, Any]
    batch_size: int
    baseline_sample: int  # requests asked for (0: no baseline)
    baseline_requests: int | None  # requests measured
    decode_wall_s: float
    started_at: datetime | None
    error: str | None
    requests: list[RequestPoint]
    baseline: list[BaselinePoint]


def job_report_data(session: Session, job_id: str) -> JobReportData:
    """The report data of one job (raises JobNotFoundError for an unknown id)."""
    job = get_job(session, job_id)
    summary = job_summary_row(session, job_id) or {}
    rows = session.execute(
        select(
            Request.id,
            Request.custom_id,
            Request.line_number,
            Request.status,
            Request.output_tokens,
            Request.draft_tokens,
            Request.accepted_tokens,
            Request.target_forwards,
            Request.accepted_length_histogram,
            Request.drafted_per_position,
            Request.accepted_per_position,
            Request.wall_s,
            Request.started_at,
            Request.completed_at,
        )
        .where(Request.job_id == job_id)
        .order_by(Request.line_number)
        .execution_options(yield_per=1000)
    )
    requests = [RequestPoint(*row) for row in rows]
    pairs = session.execute(
        select(
            BaselineSample.request_id,
            Request.custom_id,
            Request.line_number,
            BaselineSample.speculative_output_tokens,
            BaselineSample.speculative_target_forwards,
            BaselineSample.speculative_wall_s,
            BaselineSample.baseline_output_tokens,
            BaselineSample.baseline_wall_s,
        )
        .join(Request, Request.id == BaselineSample.request_id)
        .where(BaselineSample.job_id == job_id)
        .order_by(Request.line_number)
    )
    return JobReportData(
        job_id=job.id,
        summary=summary,
        batch_size=job.batch_size,
        baseline_sample=job.baseline_sample,
        baseline_requests=job.baseline_requests,
        decode_wall_s=job.decode_wall_s,
        started_at=job.started_at,
        error=job.error,
        requests=requests,
        baseline=[BaselinePoint(*row) for row in pairs],
    )


def job_history(session: Session, *, since: datetime | None = None) -> list[dict[str, Any]]:
    """``job_summary`` rows created at or after `since` (all when None), oldest first."""
    q = select(job_summary).order_by(job_summary.c.created_at, job_summary.c.job_id)
    if since is not None:
        q = q.where(job_summary.c.created_at >= since)
    return [dict(r) for r in session.execute(q).mappings()]
