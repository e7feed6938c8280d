"""What `spec-batch serve` runs: the served pair loaded once, its engine, the app's context and uvicorn.

`build_context` makes the ServerContext: `served` (ServedModel), `engine` (the shared Engine), `decoder` (the
engine as a Decoder: batch jobs in the server process decode through the same steps as online requests), `batches`
(the batch runner), `validator` (validates new batches after POST /v1/batches returned), and services [engine, batch
runner, validator, housekeeping]: started in that order, stopped in reverse, so on shutdown the batch runner hands
its work back first and the engine then finishes the online requests in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.core.decoder_like import DecoderLike
from spec_batch.core.engine import Engine
from spec_batch.server.app import create_app
from spec_batch.server.batch_runner import make_batch_runner
from spec_batch.server.batch_validation import make_batch_validator
from spec_batch.server.context import ServerContext
from spec_batch.server.housekeeping import Housekeeping
from spec_batch.server.served import ServedModel
from spec_batch.settings import Settings

if TYPE_CHECKING:
    from spec_batch.core.decoder import Decoder  # the engine decodes on it

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    target: str
    draft: str
    device: str = "cpu"
    dtype: str | None = None
    weights: str | None = None
    draft_weights: str | None = None
    num_draft_tokens: int | None = None
    adaptive: bool = True
    tree_width: int | None = None  # a head's draft trees (load_decoder's); None: its default
    max_batch: int = 8  # rows decoding at once in the shared engine (online requests and batch rows together)
    # the draft policy's bound on a row's slowdown beside rows that draft more (core/policy.py); None: tokens/s alone
    latency_slack: float | None = 0.1


def served_model(options: ServeOptions, decoder: DecoderLike) -> ServedModel:
    """The served pair named as jobs name it: model id = the target as given, drafter = the decoder's; weights
    and dtype as the loaded target runs (None: full weights / the default dtype)."""
    target = getattr(getattr(decoder, "precision", None), "target", None)
    weights = target.weights if target is not None and target.weights != "full" else None
    return ServedModel(
        model_id=options.target, target=options.target, drafter=decoder.draft_name, weights=weights, dtype=options.dtype
    )


def build_context(
    settings: Settings,
    options: ServeOptions,
    session_factory: sessionmaker[Session],
    decoder: Decoder | None = None,
) -> ServerContext:
    """Loads the pair (unless a decoder is given: tests) and builds the context; nothing starts yet."""
    if decoder is None:
        from spec_batch.jobs.heads import resolve_with_settings, split_head
        from spec_batch.loading import load_decoder

        decoder = load_decoder(
            options.target,
            resolve_with_settings(options.draft, settings),
            device=options.device,
            dtype=options.dtype,
            num_draft_tokens=options.num_draft_tokens,
            adaptive=options.adaptive,
            cache_dir=str(settings.cache_dir),
            weights=options.weights,
            draft_weights=options.draft_weights,
            tree_width=options.tree_width,
            # a head keeps the name jobs and queues know it by (head:NAME), not its cache dir
            draft_alias=options.draft if split_head(options.draft) else None,
            latency_slack=options.latency_slack,
        )
    engine = Engine(decoder, max_batch=options.max_batch)
    served = served_model(options, decoder)
    ctx = ServerContext(
        settings=settings,
        session_factory=session_factory,
        served=served,
        engine=engine,
        decoder=engine.as_decoder(),
        services=[engine],
    )
    ctx.services.append(make_batch_runner(ctx))  # after the engine: stopped before it
    ctx.services.append(make_batch_validator(ctx))  # validates new batches, hands them to the runner
    ctx.services.append(Housekeeping(ctx))  # expiry of batches past their completion_window, retention
    return ctx


def run(ctx: ServerContext, host: str, port: int, *, log_level: str = "info") -> None:
    """Serves until SIGINT/SIGTERM; uvicorn then stops accepting, lets in-flight requests (streams included)
    finish, and the app's lifespan stops the services."""
    import uvicorn

    from ..heap import freeze_heap

    freeze_heap()  # the model and the app are loaded: later full collections skip them
    uvicorn.run(create_app(ctx), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)
