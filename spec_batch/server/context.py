"""The server's one context (settings, the store, the served model, its engine, the batch runner and validator,
background services) and the FastAPI dependency that hands it to a route: ``ctx: Context``. Router modules import this module,
never app.py (app.py imports the routers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Protocol

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from spec_batch.server.served import ServedModel
from spec_batch.settings import Settings

if TYPE_CHECKING:
    from spec_batch.core.decoder_like import DecoderLike
    from spec_batch.core.engine import Engine
    from spec_batch.server.batch_create import JobFields


class Service(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class BatchRunnerLike(Service, Protocol):
    """Where the Batches API's batches run (server/batch_runner.py: in this process, or on the Celery queue)."""

    def job_fields(self) -> JobFields: ...

    def check_ready(self) -> None: ...

    def submitted(self, batch_id: str) -> None: ...


class BatchValidatorLike(Service, Protocol):
    """Validates the Batches API's batches after POST /v1/batches returned (server/batch_validation.py)."""

    def submit(self, batch_id: str) -> None: ...


@dataclass
class ServerContext:
    settings: Settings
    session_factory: sessionmaker[Session]
    served: ServedModel  # the pair this server serves, named as jobs and queues name it
    engine: Engine | None = None  # the shared engine of online requests; None where no model is loaded here
    # What batch jobs decode through in this process: Decoder's interface (generate, tokenizer, target_name,
    # draft_name, max_context, without_speculation, ...), the engine's as_decoder() under `serve`, so batch rows
    # share the online requests' steps; None where no model is loaded here (batches run on the queue).
    decoder: DecoderLike | None = None
    batches: BatchRunnerLike | None = None  # the Batches API's runner (batch_runner.make_batch_runner sets it)
    # Validates new batches after POST /v1/batches returned (batch_validation.make_batch_validator sets it); None:
    # POST /v1/batches validates the file itself before it returns.
    validator: BatchValidatorLike | None = None
    services: list[Service] = field(default_factory=list)  # started in order with the app, stopped in reverse

    @property
    def model_id(self) -> str:
        """The served model's name; a request may also say "default"."""
        return self.served.model_id


def context_of(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


Context = Annotated[ServerContext, Depends(context_of)]
