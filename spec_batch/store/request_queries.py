"""Reading a job's request rows: ids by status, decoding inputs, failures, attempts. Every function takes a
Session the caller owns; none writes. store/queries.py re-exports these names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import REQ_FAILED, REQUEST_OPEN, REQUEST_STATUSES, Request


def request_ids(
    session: Session, job_id: str, statuses: Iterable[str] | None = None, among: Iterable[int] | None = None
) -> list[int]:
    """Ids of the job's requests (in line order), optionally only those with one of `statuses`, among `among`."""
    q = select(Request.id).where(Request.job_id == job_id)
    if among is not None:
        q = q.where(Request.id.in_(list(among)))
    if statuses is not None:
        statuses = tuple(statuses)
        unknown = set(statuses) - set(REQUEST_STATUSES)
        if unknown:
            raise ValueError(f"unknown request status(es) {sorted(unknown)}; known: {REQUEST_STATUSES}")
        q = q.where(Request.status.in_(statuses))
    return list(session.scalars(q.order_by(Request.line_number)))


class RequestInput(NamedTuple):
    """What decoding a stored request needs, and what names it in messages (its line and custom_id)."""

    id: int
    line_number: int
    custom_id: str | None
    endpoint: str
    prompt: Any
    params: dict[str, Any]
    options: dict[str, Any] | None = None  # n, tools, recorded fields (0005)


def request_inputs(session: Session, ids: Iterable[int]) -> dict[int, RequestInput]:
    """The inputs of the requests `ids`, by id."""
    rows = session.execute(
        select(
            Request.id,
            Request.line_number,
            Request.custom_id,
            Request.endpoint,
            Request.prompt,
            Request.params,
            Request.options,
        ).where(Request.id.in_(list(ids)))
    ).all()
    return {r.id: RequestInput(*r) for r in rows}


def valid_request_ids(session: Session, job_id: str) -> list[int]:
    """The job's requests that passed validation (invalid lines have no endpoint), in line order."""
    return list(
        session.scalars(
            select(Request.id)
            .where(Request.job_id == job_id, Request.endpoint.is_not(None))
            .order_by(Request.line_number)
        )
    )


def iter_requests(session: Session, job_id: str) -> Iterator[Request]:
    """Every request row of the job in line order, streamed (for exports of large jobs)."""
    yield from session.scalars(
        select(Request).where(Request.job_id == job_id).order_by(Request.line_number).execution_options(yield_per=500)
    )


def failed_requests(session: Session, job_id: str, limit: int) -> list[Any]:
    """The job's first `limit` failed requests: (line_number, custom_id, error_code, error) in line order."""
    return list(
        session.execute(
            select(Request.line_number, Request.custom_id, Request.error_code, Request.error)
            .where(Request.job_id == job_id, Request.status == REQ_FAILED)
            .order_by(Request.line_number)
            .limit(limit)
        ).all()
    )


def request_attempts(session: Session, request_id: int) -> int | None:
    return session.scalar(select(Request.attempts).where(Request.id == request_id))


def open_request_ids(session: Session, job_id: str, among: Iterable[int] | None = None) -> list[int]:
    """The job's requests still to do (pending or running), in line order; only those in `among` if given."""
    return request_ids(session, job_id, REQUEST_OPEN, among)
