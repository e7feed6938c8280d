"""The app's context as a FastAPI dependency for router modules.

Router modules are imported by app.default_routers, so they must not import spec_batch.server.app themselves
(an import cycle, which tests/test_import_rules.py refuses): they take the context through ``ServerCtx``, which reads
``request.app.state.ctx`` (set by create_app) exactly as app.Context does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

if TYPE_CHECKING:
    from spec_batch.server.app import ServerContext


def server_context(request: Request) -> "ServerContext":
    return request.app.state.ctx


# Annotated[Any, ...]: FastAPI evaluates route annotations at runtime, and ServerContext is a type-checking name.
ServerCtx = Annotated[Any, Depends(server_context)]
