"""Read queries of the job_summary view and the statistics over jobs (`spec-batch jobs / show / stats`, reports).
Every function takes a Session the caller owns; none writes."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.orm import Session

from .models import REQ_COMPLETED, REQ_FAILED, Job, Request, job_summary


def job_summary_row(session: Session, job_id: str) -> dict[str, Any] | None:
    row = session.execute(select(job_summary).where(job_summary.c.job_id == job_id)).mappings().first()
    return dict(row) if row is not None else None


def list_job_summaries(session: Session, *, limit: int | None = 20, status: str | None = None) -> list[dict[str, Any]]:
    """job_summary rows, newest first."""
    q = select(job_summary).order_by(job_summary.c.created_at.desc(), job_summary.c.job_id.desc())
    if status is not None:
        q = q.where(job_summary.c.status == status)
    if limit is not None:
        q = q.limit(limit)
    return [dict(r) for r in session.execute(q).mappings()]


def model_totals(session: Session) -> list[dict[str, Any]]:
    """Per (target, drafter), over every job: jobs, requests by outcome and the sums of the requests'
    statistics (rates are computed from these sums by spec_batch.jobs.stats, with the one definition of each),
    plus the mean and range of the jobs' measured speedups and their mean tokens/s (from job_summary)."""
    per_req = (
        select(
            Job.target,
            Job.drafter,
            func.count(func.distinct(Job.id)).label("jobs"),
            func.count(Request.id).label("n_requests"),
            func.sum(case((Request.status == REQ_COMPLETED, 1), else_=0)).label("n_completed"),
            func.sum(case((Request.status == REQ_FAILED, 1), else_=0)).label("n_failed"),
            func.coalesce(func.sum(Request.output_tokens), 0).label("output_tokens"),
            func.coalesce(func.sum(Request.draft_tokens), 0).label("draft_tokens"),
            func.coalesce(func.sum(Request.accepted_tokens), 0).label("accepted_tokens"),
            func.coalesce(func.sum(Request.target_forwards), 0).label("target_forwards"),
        )
        .select_from(Job)
        .join(Request, Request.job_id == Job.id, isouter=True)
        .group_by(Job.target, Job.drafter)
    ).subquery()
    speed = (
        select(
            job_summary.c.target,
            job_summary.c.drafter,
            func.count(job_summary.c.speedup).label("jobs_measured"),
            func.avg(job_summary.c.speedup).label("speedup"),
            func.min(job_summary.c.speedup).label("min_speedup"),
            func.max(job_summary.c.speedup).label("max_speedup"),
            func.avg(job_summary.c.tokens_per_s).label("tokens_per_s"),
        ).group_by(job_summary.c.target, job_summary.c.drafter)
    ).subquery()
    q = (
        select(
            per_req,
            speed.c.jobs_measured,
            speed.c.speedup,
            speed.c.min_speedup,
            speed.c.max_speedup,
            speed.c.tokens_per_s,
        )
        .join(speed, and_(speed.c.target == per_req.c.target, speed.c.drafter == per_req.c.drafter))
        .order_by(per_req.c.target, per_req.c.drafter)
    )
    out = []
    for r in session.execute(q).mappings():
        d = dict(r)
        for k in ("speedup", "min_speedup", "max_speedup", "tokens_per_s"):
            if d.get(k) is not None:
                d[k] = float(d[k])
        for k in ("n_completed", "n_failed", "output_tokens", "draft_tokens", "accepted_tokens", "target_forwards"):
            d[k] = int(d[k] or 0)
        out.append(d)
    return out


def job_request_totals(session: Session, job_id: str) -> dict[str, int]:
    """Sums of the job's request statistics (the inputs of job_summary's rates)."""
    row = (
        session.execute(
            select(
                func.coalesce(func.sum(Request.output_tokens), 0).label("output_tokens"),
                func.coalesce(func.sum(Request.draft_tokens), 0).label("draft_tokens"),
                func.coalesce(func.sum(Request.accepted_tokens), 0).label("accepted_tokens"),
                func.coalesce(func.sum(Request.target_forwards), 0).label("target_forwards"),
            ).where(Request.job_id == job_id)
        )
        .mappings()
        .one()
    )
    return {k: int(v) for k, v in row.items()}


def job_token_totals(session: Session, job_id: str) -> tuple[int, int]:
    """(prompt tokens, output tokens) summed over the job's requests that have statistics (every choice counted)."""
    row = session.execute(
        select(
            func.coalesce(func.sum(Request.prompt_tokens), 0), func.coalesce(func.sum(Request.output_tokens), 0)
        ).where(Request.job_id == job_id)
    ).one()
    return int(row[0]), int(row[1])


__all__ = [
    "job_request_totals",
    "job_summary_row",
    "job_token_totals",
    "list_job_summaries",
    "model_totals",
]
