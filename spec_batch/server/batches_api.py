"""The Batches API (OpenAI's /v1/batches): create a batch from an uploaded file (it answers `validating` at once;
ctx.validator validates the file afterwards), retrieve, list, cancel, and the job's HTML report. A batch is a job of the store with the same id; its status is the job's (they are OpenAI's).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict

from spec_batch.jobs.lifecycle import JobStateError
from spec_batch.jobs.service import cancel_job
from spec_batch.openai_format import ENDPOINTS
from spec_batch.reports import job_report_html
from spec_batch.server.auth import Owner
from spec_batch.server.batch_create import JobFields, create_batch, open_batch
from spec_batch.server.batch_objects import COMPLETION_WINDOWS, batch_object, list_object
from spec_batch.server.context import BatchRunnerLike, Context, ServerContext
from spec_batch.server.errors import APIError, invalid_request, not_found
from spec_batch.store import files as file_sql
from spec_batch.store.file_tables import PURPOSE_BATCH
from spec_batch.store.models import utcnow

router = APIRouter()


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; result files never expire here


def _check_create(body: CreateBatch) -> None:
    if body.endpoint not in ENDPOINTS:
        raise invalid_request(
            f"endpoint {body.endpoint!r} is not supported: use {' or '.join(ENDPOINTS)}",
            param="endpoint",
            code="invalid_value",
        )
    if body.completion_window not in COMPLETION_WINDOWS:
        raise invalid_request(
            f"completion_window {body.completion_window!r} is not supported: use '24h' (OpenAI's only window)",
            param="completion_window",
            code="invalid_value",
        )
    if body.metadata is not None and (
        len(body.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items())
    ):
        raise invalid_request(
            "metadata: at most 16 pairs, keys of at most 64 characters and values of at most 512",
            param="metadata",
            code="invalid_value",
        )


def _runner(ctx: ServerContext) -> BatchRunnerLike:
    runner = ctx.batches
    if runner is None:
        raise APIError(503, "this server runs no batches (no batch runner is configured)", code="service_unavailable")
    return runner


def _object(ctx: ServerContext, batch_id: str, owner: str | None) -> dict[str, Any]:
    with ctx.session_factory() as s:
        found = file_sql.get_batch(s, batch_id, owner)
        if found is None:
            raise not_found("batch", batch_id, param="batch_id")
        return batch_object(s, *found, model=ctx.model_id)


@router.post("/v1/batches")
def create(body: CreateBatch, ctx: Context, owner: Owner) -> dict[str, Any]:
    _check_create(body)
    with ctx.session_factory() as s:
        stored = file_sql.get_file(s, body.input_file_id, owner)
    if stored is None:
        raise not_found("file", body.input_file_id, param="input_file_id")
    if stored.purpose != PURPOSE_BATCH:
        raise invalid_request(f"file {stored.id} has purpose {stored.purpose!r}, not 'batch'", param="input_file_id")
    runner = _runner(ctx)
    runner.check_ready()
    fields: JobFields = runner.job_fields()
    opened = functools.partial(
        open_batch if ctx.validator is not None else create_batch,
        ctx.session_factory,
        input_file_id=stored.id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,
        owner=owner,
        fields=fields,
    )
    if ctx.validator is not None:  # OpenAI's shape: the batch is validating now, its file validated afterwards
        batch_id = opened()
        ctx.validator.submit(batch_id)
    else:  # a context without a validator: the file is validated before this returns
        batch_id = opened(max_line_bytes=ctx.settings.max_line_bytes, max_lines=ctx.settings.api_max_file_lines)
        runner.submitted(batch_id)
    return _object(ctx, batch_id, owner)


@router.get("/v1/batches")
def list_batches(
    ctx: Context, owner: Owner, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> dict[str, Any]:
    with ctx.session_factory() as s:
        rows = file_sql.list_batches(s, owner, after=after, limit=limit + 1)
        data = [batch_object(s, b, j, model=ctx.model_id) for b, j in rows[:limit]]
    return list_object(data, len(rows) > limit)


@router.get("/v1/batches/{batch_id}")
def retrieve(batch_id: str, ctx: Context, owner: Owner) -> dict[str, Any]:
    return _object(ctx, batch_id, owner)


@router.post("/v1/batches/{batch_id}/cancel")
def cancel(batch_id: str, ctx: Context, owner: Owner) -> dict[str, Any]:
    _object(ctx, batch_id, owner)  # a 404 for another key's batch, before anything changes
    try:
        cancel_job(ctx.session_factory, batch_id)
    except JobStateError as exc:
        raise APIError(
            409, f"batch {batch_id} cannot be cancelled: {exc}", param="batch_id", code="batch_not_cancellable"
        ) from None
    with ctx.session_factory.begin() as s:
        file_sql.mark_cancelling(s, batch_id, utcnow())
    return _object(ctx, batch_id, owner)


@router.get("/v1/batches/{batch_id}/report", response_class=HTMLResponse)
def report(batch_id: str, ctx: Context, owner: Owner) -> HTMLResponse:
    """The job's HTML report (speedup, acceptance by position, throughput): `speculative.report_url`."""
    _object(ctx, batch_id, owner)
    with ctx.session_factory() as s:
        return HTMLResponse(job_report_html(s, [batch_id]))
