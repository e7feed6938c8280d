"""HTML reports of bulk jobs: charts of acceptance, accepted lengths, throughput and the measured baseline.

``job_report_html(session, job_ids)`` and ``history_report_html(session, since=None)`` read the job database
(``spec_batch.store.report_queries``) and return one self-contained page (inline SVG charts, no scripts, no network).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.orm import Session

from ..store.models import utcnow
from ..store.report_queries import job_history, job_report_data
from .html import render
from .pages import history_page, jobs_page


def job_report_html(session: Session, job_ids: Sequence[str]) -> str:
    """One page with a section per job (in the order given). Raises JobNotFoundError for an unknown id."""
    if not job_ids:
        raise ValueError("a job report needs at least one job id")
    return render(jobs_page([job_report_data(session, j) for j in job_ids], now=utcnow()))


def history_report_html(session: Session, *, since: datetime | None = None) -> str:
    """Speedup and tokens/s of every job created at or after `since` (a timezone-aware datetime)."""
    return render(history_page(job_history(session, since=since), now=utcnow(), since=since))


__all__ = ["history_report_html", "job_report_html"]
