"""`spec-batch submit | worker`: jobs through Redis to Celery workers (see README.md, "The queue"); `cancel` and
`wait` are in cli/wait.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from ..store.models import JOB_FAILED
from ._common import (
    EXIT_FAILED,
    WEIGHT_CHOICES,
    device_option,
    draft_option,
    max_tokens_option,
    open_store_or_exit,
    parse_metadata,
    target_option,
    temperature_option,
)
from ._group import main
from .wait import err, wait_for_job


def _check_model(spec: str, what: str) -> None:
    from ..core.drafting.drafter_registry import DRAFTERS
    from ..errors import SpecBatchError
    from ..loading import resolve_spec

    if what == "drafter" and DRAFTERS.claims(spec):
        return  # no model of its own ("self:int4" is the target's file; a head is resolved by the worker)
    try:
        resolve_spec(spec)
    except SpecBatchError as exc:
        raise click.ClickException(
            f"{what} {spec!r}: {exc}\n(workers on other machines may have models this one lacks: "
            f"pass --no-model-check to submit anyway)"
        ) from exc


def _queue_names(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Checks queue names given by hand (--queue, --queues, comma-separated): the allowed characters and length
    (spec_batch.workers.routing), or a usage error naming the option."""
    from ..workers.routing import QueueNameError, check_queue_name

    given = [value] if isinstance(value, str) else [n.strip() for v in value or () for n in v.split(",") if n.strip()]
    for name in given:
        try:
            check_queue_name(name)
        except QueueNameError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


# ---------------------------------------------------------------- submit


@main.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@target_option
@draft_option
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Decoding batch size on the worker."
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=None,
    help="Requests per task (default: $SPEC_BATCH_CHUNK_SIZE or 32). Smaller spreads a job over more "
    "workers; larger costs less per request.",
)
@click.option(
    "--baseline-sample",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests decoded again without speculation to measure the speedup (0: off).",
)
@max_tokens_option
@temperature_option
@click.option(
    "--queue",
    "queue",
    default=None,
    callback=_queue_names,
    help="Queue name (default: derived from target and drafter; `spec-batch worker --model` serves it).",
)
@click.option("--metadata", "metadata", multiple=True, metavar="KEY=VALUE", help="Stored with the job (repeatable).")
@click.option("--no-model-check", is_flag=True, help="Do not check that the models exist on this machine.")
@click.option(
    "--weights",
    type=click.Choice(WEIGHT_CHOICES, case_sensitive=False),
    default=None,
    help="The job's target weights (default: $SPEC_BATCH_WEIGHTS or auto, resolved here for $SPEC_BATCH_DEVICE or "
    "the CPU: w4a8 where the native kernels build, else full); with --dtype, part of the queue name: workers "
    "started with the same --weights/--dtype serve it.",
)
@click.option(
    "--dtype", default=None, help="The job's compute dtype (default: the worker device's; int4/int8: bfloat16)."
)
@click.option("--wait", "wait_after", is_flag=True, help="Then wait for the job (as `spec-batch wait`).")
def submit_command(
    file: Path,
    target: str | None,
    draft: str | None,
    batch_size: int,
    chunk_size: int | None,
    baseline_sample: int,
    max_tokens: int,
    temperature: float,
    queue: str | None,
    metadata: tuple[str, ...],
    no_model_check: bool,
    weights: str | None,
    dtype: str | None,
    wait_after: bool,
) -> None:
    """Validate FILE.jsonl, store it as a job and enqueue its chunks for the workers. Prints the job id.

    The job and its requests are committed before anything is published; Redis down means a clear error and
    no job. Follow it with `spec-batch wait JOB`; results with `spec-batch results JOB -o OUT.jsonl`.
    """
    from ..settings import get_settings
    from ..workers.enqueue import BrokerUnavailableError, PartialEnqueueError, submit_file

    meta = parse_metadata(metadata)
    settings = get_settings()
    target, draft, job_weights, job_dtype = _job_models(
        settings, target, draft, weights, dtype, check=not no_model_check
    )
    session_factory = open_store_or_exit()
    try:
        res = submit_file(
            session_factory,
            file,
            target=target,
            drafter=draft,
            batch_size=batch_size,
            baseline_sample=baseline_sample,
            chunk_size=chunk_size,
            sampling_defaults={"max_new_tokens": max_tokens, "temperature": temperature},
            metadata=meta or None,
            queue=queue,
            weights=job_weights,
            dtype=job_dtype,
        )
    except BrokerUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    except PartialEnqueueError as exc:
        click.echo(exc.job_id)
        err(f"warning: {exc}")
        sys.exit(1)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    _print_submitted(res, file, session_factory)
    click.echo(res.job_id)
    if wait_after and res.status != JOB_FAILED:
        sys.exit(wait_for_job(session_factory, res.job_id, interval=1.0, timeout=None, output=None, quiet=False))
    if res.status == JOB_FAILED:
        sys.exit(EXIT_FAILED)


def _print_submitted(res: Any, file: Path, session_factory: Any) -> None:
    """On stderr: what was stored and enqueued, the first invalid lines, a job that failed outright, and a queue no
    running worker consumes."""
    errors = list(getattr(res.parse_report, "errors", []) or [])
    err(
        f"job {res.job_id}: {res.n_requests} request(s) from {file}, {res.n_invalid} invalid; "
        f"{res.n_chunks} chunk(s) on queue {res.queue}"
    )
    for e in errors[:5]:
        err(f"  {e.message}")  # the message names its line
    if len(errors) > 5:
        err(f"  ... and {len(errors) - 5} more (`spec-batch show {res.job_id}`)")
    if res.status == JOB_FAILED:
        err(f"job {res.job_id} failed: no valid request")
    else:
        _say_when_no_worker(session_factory, res.queue)


def _say_when_no_worker(session_factory: Any, queue: str) -> None:
    """A note on stderr when no running worker consumes the job's queue (store/servers.py): the job waits."""
    from ..store import servers
    from ..store.models import utcnow

    try:
        with session_factory() as s:
            served = servers.queue_served(s, queue, utcnow())
    except Exception:  # a note only: the job is stored and enqueued
        return
    if not served:
        err(f"note: no running worker consumes queue {queue} now; the job waits for one (spec-batch worker -Q {queue})")


def _job_models(settings, target, draft, weights, dtype, *, check: bool) -> tuple[str, str, str, str | None]:
    """The job's (target, drafter, weights, dtype) with the settings' defaults, checked here where asked."""
    target = target or settings.default_target
    draft = draft or settings.default_draft
    job_weights, job_dtype = _requested_precision(weights or settings.weights, dtype, settings.device or "cpu")
    if check:
        _check_model(target, "target")
        _check_model(draft, "drafter")
    return target, draft, job_weights, job_dtype


def _requested_precision(weights: str | None, dtype: str | None, device: str = "cpu") -> tuple[str, str | None]:
    from ..errors import InvalidParameterError
    from ..loading.load import requested_precision

    try:
        return requested_precision(weights, dtype, device)
    except InvalidParameterError as exc:
        raise click.BadParameter(str(exc), param_hint="--weights/--dtype") from exc


# ---------------------------------------------------------------- worker


@main.command("worker", context_settings={"ignore_unknown_options": True})
@click.option(
    "-m",
    "--model",
    "models",
    multiple=True,
    metavar="TARGET[:DRAFTER]",
    help="A target and drafter this worker serves (repeatable; default: the default target and "
    "drafter). Each is one queue, named by `spec_batch` routing.",
)
@click.option(
    "-Q",
    "--queues",
    "queues",
    multiple=True,
    callback=_queue_names,
    help="Queue names to serve instead of / besides --model (comma-separated or repeated).",
)
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes (each loads its models once). One per GPU: prefer one worker per GPU.",
)
@device_option
@click.option(
    "--weights",
    type=click.Choice(WEIGHT_CHOICES, case_sensitive=False),
    default=None,
    help="Serve the queues of jobs at these weights (default: $SPEC_BATCH_WEIGHTS or full).",
)
@click.option(
    "--dtype", default=None, help="... and this dtype (default: the queues of jobs that leave it to the device)."
)
@click.option(
    "--draft-weights",
    type=click.Choice(WEIGHT_CHOICES, case_sensitive=False),
    default=None,
    help="Draft models' and heads' weights (SPEC_BATCH_DRAFT_WEIGHTS, default auto: full for a draft model, "
    "int8 on the CPU for a head; drafts change speed, never outputs).",
)
@click.option(
    "--torch-threads",
    type=click.IntRange(min=1),
    envvar="SPEC_BATCH_TORCH_THREADS",
    default=None,
    help="torch threads per worker process (default: all cores, or cores / concurrency).",
)
@click.option("--pool", type=click.Choice(["prefork", "solo", "threads"]), default="prefork", show_default=True)
@click.option(
    "-n", "--hostname", default=None, help="Celery node name (default: spec-batch-PID@HOST, unique per worker)."
)
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker_command(
    models: tuple[str, ...],
    queues: tuple[str, ...],
    concurrency: int,
    device: str | None,
    weights: str | None,
    dtype: str | None,
    draft_weights: str | None,
    torch_threads: int | None,
    pool: str,
    hostname: str | None,
    loglevel: str,
    celery_args: tuple[str, ...],
) -> None:
    """Start a Celery worker that runs the chunks of the queues it serves (extra arguments go to celery).

    --device and --torch-threads reach the worker processes as SPEC_BATCH_DEVICE and SPEC_BATCH_TORCH_THREADS
    (they read them through spec_batch.settings, as every other setting)."""
    from ..settings import get_settings, shown_url

    settings = get_settings()
    names = _worker_queues(models, queues, weights or settings.weights, dtype, device or settings.device)
    if draft_weights:
        os.environ["SPEC_BATCH_DRAFT_WEIGHTS"] = draft_weights
    if device:
        os.environ["SPEC_BATCH_DEVICE"] = device
    if torch_threads:
        os.environ["SPEC_BATCH_TORCH_THREADS"] = str(torch_threads)
    _check_database()
    err(
        f"spec-batch worker: queues {', '.join(names)}; concurrency {concurrency}; "
        f"lease {settings.lease_seconds}s; broker {shown_url(settings.broker_url)}"
    )
    from ..workers.celery_app import app

    argv = [
        "worker",
        f"--loglevel={loglevel}",
        "-Q",
        ",".join(names),
        f"--concurrency={concurrency}",
        f"--pool={pool}",
        "-n",
        hostname or f"spec-batch-{os.getpid()}@%h",
        *celery_args,
    ]
    app.worker_main(argv)


def _worker_queues(
    models: tuple[str, ...], queues: tuple[str, ...], weights: str | None, dtype: str | None, device: str | None = None
) -> list[str]:
    """The queues a worker serves: those named (comma lists too), then each TARGET[:DRAFT] pair's at the requested
    precision as the worker's device resolves it (None: cuda where available, as workers/runtime.py picks; a CUDA
    worker's auto is full); the default pair's when neither is given. Each once, in that order."""
    from ..settings import get_settings
    from ..workers.routing import parse_model_pair, queue_name

    settings = get_settings()
    names: list[str] = []
    for q in queues:
        names += [n.strip() for n in q.split(",") if n.strip()]
    pairs = []
    for m in models:
        try:
            pairs.append(parse_model_pair(m, settings.default_draft))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--model") from exc
    if not pairs and not names:
        pairs = [(settings.default_target, settings.default_draft)]
    job_weights, job_dtype = _requested_precision(weights, dtype, device or _default_worker_device())
    names += [queue_name(t, d, job_weights, job_dtype) for t, d in pairs]
    return list(dict.fromkeys(names))


def _default_worker_device() -> str:
    from ..workers.runtime import default_device

    return default_device()


def _check_database() -> None:
    """A database that is not migrated is a configuration error: say so now, not on every chunk. One that
    cannot be reached may come back: warn and start (the tasks retry). The engine is disposed before the
    worker forks its pool, so no connection is shared across the fork."""
    from ..settings import get_settings, redact, shown_url
    from ..store import DatabaseNotMigratedError, open_store

    url = get_settings().database_url
    try:
        session_factory = open_store(url)
    except DatabaseNotMigratedError as exc:
        raise click.ClickException(redact(str(exc), url)) from exc
    except Exception as exc:
        err(
            f"warning: cannot open the database {shown_url(url)} now ({redact(str(exc), url)}); "
            f"starting anyway, chunks are retried until it is back"
        )
        return
    session_factory.kw["bind"].dispose()
