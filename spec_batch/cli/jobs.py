"""`spec-batch run | resume | results`: bulk jobs in-process (their history: cli/history.py; the schema: cli/db.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..heap import freeze_heap
from ..store.models import JOB_CANCELLED, JOB_CANCELLING, JOB_COMPLETED, JOB_EXPIRED, JOB_FAILED
from ._common import (
    EXIT_CANCELLED,
    EXIT_COMPLETED,
    EXIT_EXPIRED,
    EXIT_FAILED,
    EXIT_NOT_FINISHED,
    EXIT_OUTPUT_NOT_WRITTEN,
    max_tokens_option,
    model_options,
    open_store_or_exit,
    parse_metadata,
    resolve_job,
    temperature_option,
    weights_options,
)
from ._group import main
from ._job_display import _console, _print_summary
from ._run_display import _running


def _load_decoder(
    target: str,
    draft: str,
    device: str | None,
    dtype: str | None,
    weights: str | None = None,
    draft_weights: str | None = None,
):
    from .. import SpecBatchError, load_decoder
    from ..jobs.heads import resolve_with_settings
    from ..settings import get_settings

    settings = get_settings()
    device = device or settings.device or "cpu"
    console = _console(stderr=True)
    try:
        with console.status(f"loading target {target!r} with drafter {draft!r} on {device} ..."):
            decoder = load_decoder(
                target=target,
                draft=resolve_with_settings(draft, settings),
                device=device,
                dtype=dtype,
                cache_dir=str(settings.cache_dir),
                weights=weights or settings.weights,
                draft_weights=draft_weights or settings.draft_weights,
                tree_width=settings.tree_width,
            )
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc
    freeze_heap()  # this process runs the job with this decoder to its end: later full collections skip it
    return decoder


def _exit_code(session_factory, job_id: str) -> int:
    """The exit code of a command that ran or resumed the job, from how the job stands (README: Exit codes)."""
    from ..store import queries

    with session_factory() as s:
        job = queries.get_job(s, job_id)
        status, error = job.status, job.error
    if status == JOB_COMPLETED:
        return EXIT_OUTPUT_NOT_WRITTEN if error else EXIT_COMPLETED
    if status in (JOB_CANCELLED, JOB_CANCELLING):
        return EXIT_CANCELLED
    if status == JOB_FAILED:
        return EXIT_FAILED
    if status == JOB_EXPIRED:
        return EXIT_EXPIRED
    return EXIT_NOT_FINISHED  # requests still held by another process, or left for the workers


def _print_line_errors(errors, console) -> None:
    for err in errors[:5]:
        console.print(f"  [red]{err.message}[/]", markup=True, highlight=False)
    if len(errors) > 5:
        console.print(f"  ... and {len(errors) - 5} more in the errors file")


def _default_output(file: Path) -> Path:
    """FILE.jsonl -> ./FILE.results.jsonl"""
    stem = file.name[: -len(".jsonl")] if file.name.endswith(".jsonl") else file.stem
    return Path.cwd() / f"{stem}.results.jsonl"


@main.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path),  # a folder is the output guard's refusal (exit 1), not a usage error
    default=None,
    help="Output JSONL (default: FILE's name with .results.jsonl, in the current directory). "
    "Invalid lines and failed requests go to OUT.errors.jsonl beside it.",
)
@click.option("--force", is_flag=True, help="Replace OUT.jsonl (and OUT.errors.jsonl) if they exist.")
@model_options
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the core's choice for the device).")
@weights_options
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--baseline-sample",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests decoded again without speculation to measure the speedup (0: off, speedup NULL).",
)
@max_tokens_option
@temperature_option
@click.option("--metadata", "metadata", multiple=True, metavar="KEY=VALUE", help="Stored with the job (repeatable).")
def run_command(
    file: Path,
    output: Path | None,
    force: bool,
    target: str | None,
    draft: str | None,
    device: str | None,
    dtype: str | None,
    weights: str | None,
    draft_weights: str | None,
    batch_size: int,
    baseline_sample: int,
    max_tokens: int,
    temperature: float,
    metadata: tuple[str, ...],
) -> None:
    """Run the batch FILE.jsonl in-process (OpenAI Batch API input lines) and write its outputs.

    Prints the job id on stdout's first line, then the job's summary; progress goes to stderr. Interrupted
    (Ctrl-C, kill)? `spec-batch resume JOB` continues where it stopped; nothing finished is lost. The exit code
    says how the job ended (README.md: Exit codes).
    """
    from ..jobs import create_job_from_file, run_job, write_results
    from ..settings import get_settings

    meta = parse_metadata(metadata)
    settings = get_settings()
    target = target or settings.default_target
    draft = draft or settings.default_draft
    output = output or _default_output(file)
    defaults = {"max_new_tokens": max_tokens, "temperature": temperature}
    parsed = _validated(file, output, force, defaults)
    session_factory = open_store_or_exit()
    console = _console(stderr=True)
    job_options = dict(
        output_file=output,
        batch_size=batch_size,
        baseline_sample=baseline_sample,
        sampling_defaults=defaults,
        metadata=meta or None,
        report=parsed,
    )
    decoder = None
    if parsed.requests:  # an unknown model fails before any job exists
        decoder = _load_decoder(target, draft, device, dtype, weights, draft_weights)
        job_options.update(_decoder_job_fields(decoder))
    else:
        job_options.update(target=target, drafter=draft)
    job_id, parsed = create_job_from_file(session_factory, file, **job_options)
    click.echo(job_id)
    console.print(f"job [bold]{job_id}[/]: {parsed.n_lines} request(s) from {file}, {len(parsed.errors)} invalid")
    _print_line_errors(parsed.errors, console)
    if parsed.requests:
        with _running(job_id) as display:
            run_job(session_factory, job_id, decoder, **display.hooks())
    else:
        write_results(session_factory, job_id, output)  # the errors file says why every line was refused
    _print_summary(session_factory, job_id)
    sys.exit(_exit_code(session_factory, job_id))


def _validated(file: Path, output: Path, force: bool, defaults: dict):
    """The file's lines, validated; everything that can be checked without the model is checked before it loads."""
    from ..jobs import validate_file
    from ..jobs.output_guard import OutputPathError, check_output_path

    try:
        check_output_path(output, input_path=file, force=force)
        return validate_file(file, defaults)
    except (OutputPathError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


def _decoder_job_fields(decoder) -> dict:
    """The job row's fields that come from the loaded decoder: its models, limits and precision."""
    precision = getattr(decoder, "precision", None)  # None: a decoder not built by load_decoder
    return dict(
        target=decoder.target_name,
        drafter=decoder.draft_name,
        max_context=decoder.max_context,
        vocab_size=decoder.vocab_size,
        weights=precision.target.weights if precision else None,
        dtype=precision.target.dtype_name if precision else None,
    )


def _job_precision(session_factory, job_id: str, dtype: str | None) -> tuple[str | None, str | None]:
    """A job resumes at the precision it ran at (its stored weights and dtype); --dtype fills an older job's gap."""
    from ..store import queries

    with session_factory() as s:
        job = queries.get_job(s, job_id)
        return job.weights, job.dtype or dtype


@main.command("resume")
@click.argument("job")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: $SPEC_BATCH_DEVICE, else cpu).")
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16.")
@click.option(
    "--wait",
    "wait_busy",
    is_flag=True,
    help="When another live process holds some of the job's requests, wait until it lets them go "
    "(it finishes, or dies and its lease expires) instead of exiting.",
)
def resume_command(job: str, device: str | None, dtype: str | None, wait_busy: bool) -> None:
    """Continue the interrupted job JOB (an id, a unique prefix, or "latest") with its target and drafter.

    A job submitted to the queue goes back to its workers; a local one continues in this process. Requests a
    live process holds are never taken over: resume names that process and exits (or waits, with --wait)."""
    from ..jobs import JobBusyError, JobStateError, resume
    from ..workers.enqueue import BrokerUnavailableError, enqueue_job

    session_factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(session_factory, job)
    console = _console(stderr=True)
    weights, dtype = _job_precision(session_factory, job_id, dtype)

    said: list[str] = []

    def on_wait(busy) -> None:
        if str(busy) not in said:  # once per holder, not once per poll
            said.append(str(busy))
            console.print(f"waiting: {busy}")

    try:
        with _running(job_id) as display:
            outcome = resume(
                session_factory,
                job_id,
                decoder_for=lambda target, drafter: _load_decoder(target, drafter, device, dtype, weights),
                enqueue=enqueue_job,
                wait=wait_busy,
                on_wait=on_wait,
                **display.hooks(),
            )
    except JobBusyError as exc:
        console.print(f"[yellow]{exc}[/]")
        sys.exit(EXIT_NOT_FINISHED)
    except (JobStateError, BrokerUnavailableError) as exc:
        raise click.ClickException(str(exc)) from exc
    if outcome.action == "completed":
        console.print(f"job {job_id} is already completed")
    elif outcome.action == "enqueued":
        rep = outcome.enqueued
        console.print(
            f"job {job_id}: {rep.new_chunks} new chunk(s), {rep.republished} re-published on {outcome.info.queue}"
            + (f"; {outcome.running} running on workers" if outcome.running else "")
            + f"; follow it with spec-batch wait {job_id}"
        )
    _print_summary(session_factory, job_id)
    sys.exit(EXIT_COMPLETED if outcome.action == "enqueued" else _exit_code(session_factory, job_id))


@main.command("results")
@click.argument("job")
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path),  # a folder is the output guard's refusal (exit 1), not a usage error
    required=True,
    help="Output JSONL; failed requests and invalid lines go to OUT.errors.jsonl beside it.",
)
@click.option("--force", is_flag=True, help="Replace OUT.jsonl (and OUT.errors.jsonl) if they exist.")
def results_command(job: str, output: Path, force: bool) -> None:
    """Export the results of JOB (OpenAI Batch API output lines)."""
    from ..jobs import job_info, write_results
    from ..jobs.output_guard import OutputPathError, check_output_path, job_files

    session_factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(session_factory, job)
    try:
        check_output_path(
            output,
            input_path=job_info(session_factory, job_id).input_file,
            protected=job_files(session_factory, [job_id]),
            force=force,
        )
        rep = write_results(session_factory, job_id, output)
    except OutputPathError as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from exc
    console = _console()
    console.print(f"{rep.n_output} result(s) -> {rep.output_path}")
    if rep.errors_path:
        console.print(f"{rep.n_errors} error(s) -> {rep.errors_path}")
    if rep.n_open:
        console.print(f"[yellow]{rep.n_open} request(s) are not finished yet[/]: spec-batch resume {job_id}")
