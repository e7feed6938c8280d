"""Online endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (docs/server.md).

A body is parsed by the one parser of batch lines and HTTP requests (`openai_format.parse_body(online=True)`),
decoded in the server's shared engine (`ctx.engine`: requests that arrive while others decode join
their batch) and rendered like a batch output line (`online_bodies.Reply`). `stream: true` answers as
server-sent events; a client that goes away frees its rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from spec_batch.core.engine import Engine
from spec_batch.core.outputs import GenerationResult
from spec_batch.openai_format import CHAT, COMPLETIONS, BodyError, ParsedBody, parse_body
from spec_batch.server.auth import Owner
from spec_batch.server.context import Context, ServerContext
from spec_batch.server.errors import APIError, internal_error, invalid_request, model_not_found, not_found
from spec_batch.server.online_bodies import DONE, Reply, sse
from spec_batch.server.online_call import OnlineCall
from spec_batch.server.online_metrics import RequestMetrics

router = APIRouter()
log = logging.getLogger(__name__)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, ctx: Context, owner: Owner) -> Any:
    return await _complete(request, ctx, CHAT)


@router.post("/v1/completions")
async def completions(request: Request, ctx: Context, owner: Owner) -> Any:
    return await _complete(request, ctx, COMPLETIONS)


def _model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "spec-batch"}


@router.get("/v1/models")
def list_models(ctx: Context, owner: Owner) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(ctx.model_id)]}


@router.get("/v1/models/{model}")
def retrieve_model(model: str, ctx: Context, owner: Owner) -> dict[str, Any]:
    if not ctx.served.names(model):
        raise not_found("model", model, param="model", code="model_not_found")
    return _model_object(ctx.model_id)


async def _parsed(request: Request, ctx: ServerContext, endpoint: str) -> ParsedBody:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise invalid_request("the request body is nested too deeply", code="invalid_json") from None
    try:
        parsed = parse_body(endpoint, body, online=True)
    except BodyError as exc:
        raise invalid_request(str(exc), param=exc.param or None, code=exc.code) from None
    if parsed.model is not None and not ctx.served.names(parsed.model):
        raise model_not_found(parsed.model, ctx.model_id)
    return parsed


def _engine(ctx: ServerContext) -> Engine:
    if ctx.engine is None:
        raise APIError(503, "this server has no model loaded for online requests", code="service_unavailable")
    return ctx.engine


def _reply(ctx: ServerContext, parsed: ParsedBody) -> Reply:
    engine = _engine(ctx)
    tools = parsed.tools is not None and parsed.tools.choice != "none"
    return Reply(
        parsed.endpoint,
        ctx.model_id,
        engine.decoder.draft_name,
        engine.decoder.tokenizer,
        tools=tools,
        per_prompt=parsed.n,
    )


async def _complete(request: Request, ctx: ServerContext, endpoint: str) -> Any:
    parsed = await _parsed(request, ctx, endpoint)
    reply = _reply(ctx, parsed)
    call = OnlineCall(_engine(ctx), parsed)
    metrics = RequestMetrics(ctx.served, call.n)
    try:
        await call.start()
    except BaseException:
        metrics.close()
        raise
    if parsed.stream:
        return StreamingResponse(
            _events(call, reply, metrics),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        results = await call.wait(request.is_disconnected)
    finally:
        call.cancel()
        metrics.record(call.results)
    failed = next((r for r in results if r.finish_reason == "error"), None)
    if failed is not None:
        raise _decoding_failed(failed)
    return JSONResponse(reply.body(results))


def _decoding_failed(result: GenerationResult) -> APIError:
    """A request that failed while decoding: a 400 naming the field when it was the request's own (a grammar the
    engine gave up on; core/structured/grammar.py writes its message without the engine's dumps), else a 500 whose fixed text
    says nothing of the decoder (the log has the details)."""
    if result.error_param is not None:
        return invalid_request(result.error or "decoding failed", param=result.error_param, code=result.error_code)
    log.error("decoding failed: %s", result.error)
    return internal_error()


def _include_usage(parsed: ParsedBody) -> bool:
    options = parsed.recorded.get("stream_options") or {}
    return bool(options.get("include_usage"))


async def _events(call: OnlineCall, reply: Reply, metrics: RequestMetrics) -> AsyncIterator[str]:
    """The SSE stream: a role chunk per choice (chat), each step's text, the finish, usage if asked, [DONE].
    With tools the text is held back and the end says whether the answer is a call. Leaving early (the client
    went away: Starlette cancels this generator) cancels the rows."""
    try:
        if reply.chat:
            for index in range(call.n):
                yield sse(reply.chunk(index, text="", role=True))
        async for index, update in call.updates():
            result, chunk = update.result, update.chunk
            if result is not None and result.finish_reason == "error":
                yield sse(_decoding_failed(result).body())
                return
            if reply.tools:
                if result is not None:
                    yield sse(reply.tool_call_chunk(index, result))
                continue
            if chunk.text or chunk.logprobs or result is not None:
                yield sse(
                    reply.chunk(
                        index,
                        text=chunk.text,
                        logprobs=chunk.logprobs,
                        finish_reason=result.finish_reason if result is not None else None,
                    )
                )
        if _include_usage(call.parsed):
            yield sse(reply.usage_chunk([r for r in call.results if r is not None]))
        yield DONE
    finally:
        call.cancel()
        metrics.record(call.results)
