"""The ASGI app of `spec-batch serve`: one ServerContext (context.py: settings, the store, the served model, the
services that run in the background), the routers of each API, OpenAI's error bodies and bearer-key auth.

The parts plug in here and nowhere else:
- a router module exposes ``router: APIRouter`` and is listed in :func:`default_routers`;
- a background service (the online engine, the batch runner) is a :class:`Service` in ``ServerContext.services``:
  started in order when the app starts, stopped in reverse when it shuts down (``stop`` returns once in-flight
  work is finished or handed back to the queue).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from spec_batch.server.auth import KeyRing
from spec_batch.server.body_limit import BodyLimit
from spec_batch.server.context import Context, ServerContext, Service
from spec_batch.server.errors import install_error_handlers

health = APIRouter()


@health.get("/health", include_in_schema=False)
def _health(ctx: Context) -> dict[str, str]:
    return {"status": "ok", "model": ctx.model_id}


def default_routers() -> list[APIRouter]:
    from spec_batch.server import batches_api, files_api, online, online_metrics  # imported when the app is made

    return [health, online_metrics.router, online.router, files_api.router, batches_api.router]


def create_app(ctx: ServerContext, routers: Sequence[APIRouter] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        started: list[Service] = []
        try:
            for service in ctx.services:
                await asyncio.to_thread(service.start)
                started.append(service)
            yield
        finally:
            for service in reversed(started):
                await asyncio.to_thread(service.stop)

    # The interactive docs and the schema are off unless asked (SPEC_BATCH_API_DOCS=1): with keys on, every endpoint
    # but /health and /metrics needs a key, and these three would be the exception. Asked for, they are served
    # without a key (the schema of the API, no user data), as docs/server.md says.
    docs = ctx.settings.api_docs
    app = FastAPI(
        title="spec-batch",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.ctx = ctx
    app.state.keys = KeyRing(ctx.settings.api_keys)
    install_error_handlers(app)
    app.add_middleware(BodyLimit)
    for router in default_routers() if routers is None else routers:
        app.include_router(router)
    return app
