"""Helpers shared by the `spec-batch` command modules: the model options, opening the store, naming a job,
--metadata, and the exit codes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..core.drafting.drafter_registry import DRAFTERS
from ..limits import TEMPERATURE, Range

F = TypeVar("F", bound=Callable[..., Any])

# Exit codes of commands that run or follow a job (README.md, "Exit codes"). Click's own usage errors exit 2.
EXIT_COMPLETED = 0
EXIT_FAILED = 1  # the job failed (no valid line), or the command stopped before it could run it
EXIT_CANCELLED = 2
EXIT_TIMEOUT = 3  # `spec-batch wait --timeout`
EXIT_OUTPUT_NOT_WRITTEN = 4  # the job completed but its output file could not be written
EXIT_NOT_FINISHED = 5  # another live process holds some of the job's requests (resume: it says which)
EXIT_EXPIRED = 6  # a batch of the API not finished within its completion_window: what was done is in its output
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: `spec-batch resume JOB` continues


def limit_type(allowed: Range, *, integer: bool = False) -> click.ParamType:
    """A click type for a request parameter, from its range in spec_batch.limits (OpenAI's, as every boundary)."""
    if integer:
        return click.IntRange(min=int(allowed.low), max=int(allowed.high), min_open=allowed.low_open)
    return click.FloatRange(min=allowed.low, max=allowed.high, min_open=allowed.low_open)


def temperature_option(f: F) -> F:
    """--temperature of `run` and `submit`: for lines without one."""
    return click.option(
        "--temperature",
        type=limit_type(TEMPERATURE),
        default=0.0,
        show_default=True,
        help="For lines without temperature (0 = greedy).",
    )(f)


def target_option(f: F) -> F:
    return click.option(
        "--target",
        default=None,
        help='Target model: "default", a hub id, a local dir or a .gguf file (default: $SPEC_BATCH_DEFAULT_TARGET '
        'or "default").',
    )(f)


def draft_option(f: F) -> F:
    return click.option(
        "--draft",
        default=None,
        help=f"Drafter: {DRAFTERS.listing()}, "
        'a draft model (hub id, dir, .gguf), "head:NAME" (a head trained by '
        '`spec-batch drafters train`, or head:/path/dir) or "hybrid:NAME" (suffix where confident, the head '
        'elsewhere) (default: $SPEC_BATCH_DEFAULT_DRAFT or "suffix").',
    )(f)


def device_option(f: F) -> F:
    return click.option(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1, ... (default: $SPEC_BATCH_DEVICE, else cpu; a worker: else cuda when available).",
    )(f)


WEIGHT_CHOICES = (
    "full",
    "int8",
    "int4",
    "w4a8",
    "auto",
)  # spec_batch.loading.weights.WEIGHT_CHOICES (not imported: fast --help)


def weights_options(f: F) -> F:
    """--weights and --draft-weights: the weight storage of the target and of a draft model."""
    choice = click.Choice(WEIGHT_CHOICES, case_sensitive=False)
    f = click.option(
        "--draft-weights",
        type=choice,
        default=None,
        help="A draft model's weights, as --weights (default: $SPEC_BATCH_DRAFT_WEIGHTS or auto: full for a draft "
        "model, int8 on the CPU for a head). --draft self:int4 drafts with the target's own file at int4.",
    )(f)
    return click.option(
        "--weights",
        type=choice,
        default=None,
        help="Target weights: full (the file's weights in dtype) | int8 | int4 | w4a8 (GGUF Q4/Q8 tensors as they "
        "ship) | auto (default: $SPEC_BATCH_WEIGHTS or auto: w4a8 on the CPU where the native kernels build, else "
        "full). docs/weights.md.",
    )(f)


def max_tokens_option(f: F) -> F:
    return click.option(
        "--max-tokens",
        type=click.IntRange(min=1),
        default=256,
        show_default=True,
        help="For lines without max_tokens.",
    )(f)


def model_options(f: F) -> F:
    """--target and --draft (the job's models) and --device."""
    return target_option(draft_option(device_option(f)))


def open_store_or_exit(*, must_exist: bool = False):
    """The session factory for the configured database, or a clean CLI error naming it (password masked).

    must_exist: a read-only command on a SQLite file that does not exist says so instead of creating it."""
    from ..errors import SpecBatchError
    from ..settings import get_settings, redact, shown_url
    from ..store import open_store

    url = get_settings().database_url
    try:
        return open_store(url, create=not must_exist)
    except SpecBatchError as exc:
        raise click.ClickException(redact(str(exc), url)) from exc
    except Exception as exc:
        raise click.ClickException(f"cannot open the database {shown_url(url)}: {redact(str(exc), url)}") from exc


def resolve_job(factory, ref: str) -> str:
    """A job id from an id, a unique prefix or "latest", or a clean CLI error."""
    from ..store import queries

    try:
        with factory() as s:
            return queries.resolve_job_id(s, ref)
    except queries.JobNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc


def parse_metadata(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--metadata KEY=VALUE` options as a dict; a malformed one is a usage error naming it."""
    meta: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--metadata")
        meta[key] = value
    return meta
