"""`spec-batch serve`: the OpenAI-compatible server (docs/server.md) over one target and drafter pair."""

from __future__ import annotations

import click

from ._common import device_option, draft_option, open_store_or_exit, target_option, weights_options
from ._group import main


@main.command("serve")
@click.option(
    "--host",
    default=None,
    help="Address to bind (default: $SPEC_BATCH_API_HOST or 127.0.0.1: this "
    "machine only; 0.0.0.0 serves every interface: set SPEC_BATCH_API_KEYS then).",
)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=None, help="Port (default: $SPEC_BATCH_API_PORT or 8000)."
)
@target_option
@draft_option
@device_option
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA).")
@weights_options
@click.option(
    "--runner",
    type=click.Choice(["local", "queue"]),
    default=None,
    help="Where batches run: local (in this process, on the same engine) | queue (the Celery workers of "
    "the served pair) (default: $SPEC_BATCH_API_RUNNER or local).",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Rows decoding at once in the shared engine (online requests and batch rows together).",
)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(min=0),
    default=None,
    help="Longest draft per step.  [default: the drafter's]",
)
@click.option(
    "--latency-slack",
    default=None,
    help="The draft policy's bound on a request's slowdown beside requests that draft more: no row's expected "
    "tokens/s below plain decoding's by more than this share, or 'off' (tokens/s alone, as jobs run) "
    "(default: $SPEC_BATCH_LATENCY_SLACK or 0.1).",
)
@click.option(
    "--require-keys",
    is_flag=True,
    help="Refuse to start without SPEC_BATCH_API_KEYS or "
    "SPEC_BATCH_API_KEYS_FILE (a server that other machines reach: the compose api service).",
)
def serve(
    host: str | None,
    port: int | None,
    target: str | None,
    draft: str | None,
    device: str | None,
    dtype: str | None,
    weights: str | None,
    draft_weights: str | None,
    runner: str | None,
    max_batch: int,
    num_draft_tokens: int | None,
    latency_slack: str | None,
    require_keys: bool,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models (and the Files and Batches API) over HTTP."""
    import dataclasses

    from ..errors import SpecBatchError
    from ..server.serve import ServeOptions, build_context, run
    from ..settings import get_settings

    settings = _with_latency_slack(get_settings(), latency_slack)
    if runner is not None:
        settings = dataclasses.replace(settings, api_runner=runner)
    host = host or settings.api_host
    port = port or settings.api_port
    if require_keys and not settings.api_keys:
        raise click.UsageError("--require-keys: set SPEC_BATCH_API_KEYS (comma-separated) or SPEC_BATCH_API_KEYS_FILE")
    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        click.echo(
            f"warning: serving on {host} without SPEC_BATCH_API_KEYS: anyone who reaches it can use it", err=True
        )
    options = ServeOptions(
        target=target or settings.default_target,
        draft=draft or settings.default_draft,
        device=device or settings.device or "cpu",
        dtype=dtype,
        weights=weights or settings.weights,
        draft_weights=draft_weights or settings.draft_weights,
        num_draft_tokens=num_draft_tokens if num_draft_tokens is not None else settings.num_draft_tokens,
        adaptive=settings.adaptive,
        max_batch=max_batch,
        tree_width=settings.tree_width,
        latency_slack=settings.latency_slack,
    )
    session_factory = open_store_or_exit()
    try:
        ctx = build_context(settings, options, session_factory)
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"serving {ctx.model_id!r} (drafter {ctx.served.drafter}, batches: {settings.api_runner}) "
        f"on http://{host}:{port}/v1",
        err=True,
    )
    run(ctx, host, port)


def _with_latency_slack(settings, raw: str | None):
    """settings with --latency-slack's value where given (read as SPEC_BATCH_LATENCY_SLACK is)."""
    import dataclasses

    from ..settings import SettingsError, parse_latency_slack

    if raw is None:
        return settings
    try:
        return dataclasses.replace(settings, latency_slack=parse_latency_slack(raw, "--latency-slack"))
    except SettingsError as exc:
        raise click.BadParameter(str(exc), param_hint="--latency-slack") from None
