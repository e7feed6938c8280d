"""The Files API (OpenAI's /v1/files): upload a batch file, list, read, download and delete files.

Uploads go to the database (files + file_chunks), so every API replica and worker sees them. The multipart body is
refused at once when its Content-Length is over the limit; otherwise Starlette spools it (at most 1 MB in memory)
and it is copied into the database chunk by chunk, counting bytes and lines, and refused with a 413 the moment it
passes a limit (nothing is stored). A batch's output and error files (purpose batch_output) are listed here too once
its batch names them; deleting one makes it unresolvable (the job's rows stay until the batch goes).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from spec_batch.jobs.export import OUTPUT
from spec_batch.server.auth import Owner
from spec_batch.server.batch_objects import (
    PURPOSE_BATCH_OUTPUT,
    file_object,
    iter_result_bytes,
    list_object,
    parse_result_file_id,
    result_created_at,
    result_file_object,
    result_files,
)
from spec_batch.server.context import Context, ServerContext
from spec_batch.server.errors import invalid_request, not_found, too_large
from spec_batch.server.file_io import iter_content, store_upload
from spec_batch.store import files as file_sql
from spec_batch.store import queries
from spec_batch.store.file_tables import PURPOSE_BATCH
from spec_batch.store.models import utcnow

router = APIRouter()
_MULTIPART_SLACK = 1 << 20  # room for the multipart envelope and the purpose field around the file itself


def _check_content_length(request: Request, max_bytes: int) -> None:
    raw = request.headers.get("content-length")
    if raw is not None and raw.isdigit() and int(raw) > max_bytes + _MULTIPART_SLACK:
        raise too_large(
            f"the upload is {raw} bytes; files may be at most {max_bytes} bytes (SPEC_BATCH_API_MAX_FILE_BYTES)",
            param="file",
        )


def _counted(request: Request, max_bytes: int) -> Request:
    """The request with a receive that counts the body's bytes and raises a 413 once they pass the limit: a body
    without a Content-Length (chunked) is refused while it arrives, not after it was spooled whole."""
    seen = 0
    limit = max_bytes + _MULTIPART_SLACK

    async def receive() -> Any:
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(
                    f"the upload is larger than {max_bytes} bytes, the most this server takes "
                    f"(SPEC_BATCH_API_MAX_FILE_BYTES)",
                    param="file",
                )
        return message

    return Request(request.scope, receive)


async def _form_parts(request: Request, max_bytes: int) -> tuple[UploadFile, str]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid_request("upload the file as multipart/form-data with the fields 'file' and 'purpose'")
    form = await _counted(request, max_bytes).form(max_files=1, max_fields=8)
    upload, purpose = form.get("file"), form.get("purpose")
    problem = None
    if not isinstance(upload, UploadFile):
        problem = invalid_request("the multipart field 'file' is missing", param="file", code="missing_field")
    elif purpose != PURPOSE_BATCH:
        problem = invalid_request(
            f"purpose {purpose!r} is not supported: this server takes files of purpose 'batch'",
            param="purpose",
            code="invalid_value",
        )
    if problem is not None:
        await form.close()  # its spooled temporary file goes now, not when collected
        raise problem
    assert isinstance(upload, UploadFile) and isinstance(purpose, str)
    return upload, purpose


@router.post("/v1/files")
async def create_file(request: Request, ctx: Context, owner: Owner) -> dict[str, Any]:
    settings = ctx.settings
    _check_content_length(request, settings.api_max_file_bytes)
    upload, purpose = await _form_parts(request, settings.api_max_file_bytes)
    try:
        file_id = await run_in_threadpool(
            store_upload,
            ctx.session_factory,
            upload.file,
            owner=owner,
            filename=upload.filename or "upload.jsonl",
            purpose=purpose,
            max_bytes=settings.api_max_file_bytes,
            max_lines=settings.api_max_file_lines,
        )
    finally:
        await upload.close()
    with ctx.session_factory() as s:
        row = file_sql.get_file(s, file_id, owner)
        assert row is not None
        return file_object(row)


@router.get("/v1/files")
def list_files(
    ctx: Context,
    owner: Owner,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    purpose: str | None = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> dict[str, Any]:
    ascending = order == "asc"
    if purpose == PURPOSE_BATCH:  # uploads only: paged in SQL
        with ctx.session_factory() as s:
            rows = file_sql.list_files(s, owner, after=after, limit=limit + 1, purpose=purpose, ascending=ascending)
        return list_object([file_object(r) for r in rows[:limit]], len(rows) > limit)
    return _list_with_results(ctx, owner, after, limit, purpose, ascending)


def _list_with_results(
    ctx: ServerContext, owner: str | None, after: str | None, limit: int, purpose: str | None, ascending: bool
) -> dict[str, Any]:
    """Uploads and the result files of the caller's ended batches (purpose batch_output) in one list, ordered by
    (created_at, id) and paged by `after` in memory; only the page's result files are rendered (for their size)."""
    entries: list[tuple[Any, str, Any]] = []  # (created_at, id, an upload's row or (batch, job, kind))
    with ctx.session_factory() as s:
        if purpose is None:
            entries += [(r.created_at, r.id, r) for r in file_sql.list_files(s, owner, limit=None)]
        if purpose in (None, PURPOSE_BATCH_OUTPUT):
            for batch, job in file_sql.ended_batches(s, owner):
                named = result_files(job, queries.job_counts(s, job.id), batch)
                for file_id in filter(None, named):
                    kind = parse_result_file_id(file_id)[1]  # type: ignore[index]
                    entries.append((result_created_at(job), file_id, (batch, job, kind)))
    entries.sort(key=lambda e: (e[0], e[1]), reverse=not ascending)
    ids = [e[1] for e in entries]
    start = ids.index(after) + 1 if after in ids else (len(ids) if after is not None else 0)
    page = entries[start : start + limit]
    data = [
        result_file_object(ctx.session_factory, *item) if isinstance(item, tuple) else file_object(item)
        for _, _, item in page
    ]
    return list_object(data, start + limit < len(entries))


def _result_file(ctx: ServerContext, file_id: str, owner: str | None) -> tuple[Any, Any, str]:
    """(batch, job, kind) of a batch's result file the caller may see: one its batch names (output_file_id or
    error_file_id); a 404 otherwise (a batch not finished, a file with no line, another key's batch)."""
    parsed = parse_result_file_id(file_id)
    if parsed is not None:
        with ctx.session_factory() as s:
            found = file_sql.get_batch(s, parsed[0], owner)
            named = found is not None and file_id in result_files(
                found[1], queries.job_counts(s, found[1].id), found[0]
            )
        if found is not None and named:
            return found[0], found[1], parsed[1]
    raise not_found("file", file_id, param="file_id")


@router.get("/v1/files/{file_id}")
def retrieve_file(file_id: str, ctx: Context, owner: Owner) -> dict[str, Any]:
    with ctx.session_factory() as s:
        row = file_sql.get_file(s, file_id, owner)
        if row is not None:
            return file_object(row)
    batch, job, kind = _result_file(ctx, file_id, owner)
    return result_file_object(ctx.session_factory, batch, job, kind)


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, ctx: Context, owner: Owner) -> StreamingResponse:
    with ctx.session_factory() as s:
        found = file_sql.get_file(s, file_id, owner) is not None
    if found:
        body = iter_content(ctx.session_factory, file_id)
    else:
        batch, _, kind = _result_file(ctx, file_id, owner)
        body = iter_result_bytes(ctx.session_factory, batch.id, kind)
    return StreamingResponse(body, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
def delete_file(file_id: str, ctx: Context, owner: Owner) -> dict[str, Any]:
    """An upload: the file and its content go (batches made from it keep their requests). A batch's result file:
    it no longer resolves and its batch no longer names it; the job's rows stay until the batch goes (retention)."""
    with ctx.session_factory.begin() as s:
        deleted = file_sql.delete_file(s, file_id, owner)
    if not deleted:
        batch, _, kind = _result_file(ctx, file_id, owner)  # a 404 unless the batch names it
        with ctx.session_factory.begin() as s:
            file_sql.mark_result_deleted(s, batch.id, output=kind == OUTPUT, now=utcnow())
    return {"id": file_id, "object": "file", "deleted": True}
