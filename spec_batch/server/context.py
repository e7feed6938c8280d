"""The server's one context (settings, the store, the served model, background services, named parts) and the
FastAPI dependency that hands it to a route: ``ctx: Context``. Router modules import this module, never app.py
(app.py imports the routers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from spec_batch.settings import Settings


class Service(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class ServerContext:
    settings: Settings
    session_factory: sessionmaker[Session]
    model_id: str  # the served model's name; a request may also say "default"
    services: list[Service] = field(default_factory=list)
    parts: dict[str, Any] = field(default_factory=dict)  # named parts the routers look up ("engine", "batches")

    def part(self, name: str) -> Any:
        return self.parts[name]


def context_of(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


Context = Annotated[ServerContext, Depends(context_of)]
