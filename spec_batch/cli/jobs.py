"""`spec-batch run | resume | jobs | show | results | stats | db ...`: bulk jobs in-process, their history in SQL."""
from __future__ import annotations

import json
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from ..store.models import (
    JOB_CANCELLED,
    JOB_CANCELLING,
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    JOB_STATUSES,
    JOB_VALIDATING,
)
from ._common import (
    EXIT_CANCELLED,
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_FINISHED,
    EXIT_OUTPUT_NOT_WRITTEN,
    max_tokens_option,
    model_options,
    open_store_or_exit,
    parse_metadata,
    resolve_job,
    weights_options,
)
from ..errors import SpecBatchError
from ._group import main, mask_in_errors

STATUS_STYLE = {
    JOB_COMPLETED: "green",
    JOB_IN_PROGRESS: "yellow",
    JOB_VALIDATING: "yellow",
    JOB_FINALIZING: "yellow",
    JOB_FAILED: "red",
    JOB_CANCELLING: "magenta",
    JOB_CANCELLED: "magenta",
}


def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in __import__("os").environ:
        console.width = 200  # piped or captured: keep whole rows (job ids, paths) instead of 80 columns
    return console


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:{spec}}{suffix}"
    return f"{value}{suffix}"


def _when(value) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value is not None else "—"


def _status(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


def _load_decoder(target: str, draft: str, device: str | None, dtype: str | None, weights: str | None = None,
                  draft_weights: str | None = None):
    from .. import SpecBatchError, load_decoder
    from ..settings import get_settings

    settings = get_settings()
    device = device or settings.device or "cpu"
    console = _console(stderr=True)
    try:
        with console.status(f"loading target {target!r} with drafter {draft!r} on {device} ..."):
            return load_decoder(
                target=target, draft=draft, device=device, dtype=dtype, cache_dir=str(settings.cache_dir),
                weights=weights or settings.weights, draft_weights=draft_weights or settings.draft_weights,
            )
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc


@contextmanager
def _sigterm_as_interrupt():
    """`kill` (SIGTERM) stops a run like Ctrl-C: claimed requests go back to pending at once."""

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _summary_table(row: dict, title: str):
    from rich.table import Table

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    t.add_row("job", row["job_id"])
    t.add_row("status", _status(row["status"]))
    t.add_row("target / drafter", f"{row['target']} / {row['drafter']}")
    t.add_row("requests", f"{row['n_requests']} ({row['n_completed']} completed, {row['n_failed']} failed)")
    t.add_row("output tokens", str(row["output_tokens"]))
    t.add_row("acceptance rate", _fmt(row["acceptance_rate"], ".1%"))
    t.add_row("tokens per step", _fmt(row["tokens_per_step"]))
    t.add_row("tokens/s", _fmt(row["tokens_per_s"], ".1f"))
    t.add_row("baseline tokens/s", _fmt(row["baseline_tokens_per_s"], ".1f"))
    t.add_row("speedup (measured)", _fmt(row["speedup"], ".2f", "x"))
    t.add_row("created / completed", f"{_when(row['created_at'])} / {_when(row['completed_at'])}")
    return t


def _print_summary(factory, job_id: str, *, title: str = "Job summary") -> dict:
    from ..jobs.batchfile import errors_path_for
    from ..store import queries

    with factory() as s:
        row = queries.job_summary_row(s, job_id)
        job = queries.get_job(s, job_id)
        out, error = job.output_file, job.error
    table = _summary_table(row, title)
    if out:
        table.add_row("output", out)
        err = errors_path_for(out)
        if err.exists():
            table.add_row("errors", str(err))
    if error:
        table.add_row("error", f"[red]{error}[/]")
    _console().print(table)
    return row


class _RunDisplay:
    """The progress of a run on stderr: baseline messages, then a bar (requests done, tokens/s, acceptance)."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = _console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("requests"), TextColumn("{task.fields[tps]} tok/s"), TextColumn("acceptance {task.fields[acc]}"),
            TimeElapsedColumn(), console=self.console, transient=False,
        )
        self.task = None
        self.t0 = 0.0

    def on_phase(self, name: str, info: Any) -> None:
        if name == "baseline":
            self.console.print(
                f"measuring the baseline: {info} request(s) decoded with and without speculation "
                f"(--baseline-sample 0 skips it)"
            )
        elif name == "baseline_done" and info is not None:
            self.console.print(
                f"baseline: {_fmt(info.baseline_tokens_per_s, '.1f')} tok/s without speculation, "
                f"{_fmt(info.sample_tokens_per_s, '.1f')} with it: speedup {_fmt(info.speedup, '.2f', 'x')}"
            )
        elif name == "run":
            self.progress.start()
            self.task = self.progress.add_task("decoding", total=info, tps="—", acc="—")
            self.t0 = time.perf_counter()

    def on_progress(self, report) -> None:
        if self.task is None:
            return
        elapsed = time.perf_counter() - self.t0
        tps = report.output_tokens / elapsed if elapsed > 0 else None
        self.progress.update(
            self.task, completed=report.done, tps=_fmt(tps, ".1f"), acc=_fmt(report.acceptance_rate, ".0%")
        )

    def hooks(self) -> dict[str, Any]:
        return {"on_phase": self.on_phase, "on_progress": self.on_progress}

    def close(self) -> None:
        self.progress.stop()


@contextmanager
def _running(job_id: str):
    """A run's display; Ctrl-C or SIGTERM stop the run (claimed requests go back at once) and exit 130."""
    display = _RunDisplay()
    try:
        with _sigterm_as_interrupt():
            yield display
    except KeyboardInterrupt:
        display.close()
        _interrupted(job_id)
    finally:
        display.close()


def _interrupted(job_id: str) -> None:
    _console(stderr=True).print(
        f"[yellow]interrupted.[/] Finished requests are stored; continue with [bold]spec-batch resume {job_id}[/]"
    )
    sys.exit(EXIT_INTERRUPTED)


def _exit_code(factory, job_id: str) -> int:
    """The exit code of a command that ran or resumed the job, from how the job stands (README: Exit codes)."""
    from ..store import queries

    with factory() as s:
        job = queries.get_job(s, job_id)
        status, error = job.status, job.error
    if status == JOB_COMPLETED:
        return EXIT_OUTPUT_NOT_WRITTEN if error else EXIT_COMPLETED
    if status in (JOB_CANCELLED, JOB_CANCELLING):
        return EXIT_CANCELLED
    if status == JOB_FAILED:
        return EXIT_FAILED
    return EXIT_NOT_FINISHED  # requests still held by another process, or left for the workers


def _print_line_errors(errors, console) -> None:
    for err in errors[:5]:
        console.print(f"  [red]{err.message}[/]", markup=True, highlight=False)
    if len(errors) > 5:
        console.print(f"  ... and {len(errors) - 5} more in the errors file")


@main.command("run")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output JSONL (default: FILE's name with .results.jsonl, in the current directory). "
                   "Invalid lines and failed requests go to OUT.errors.jsonl beside it.")
@click.option("--force", is_flag=True, help="Replace OUT.jsonl (and OUT.errors.jsonl) if they exist.")
@model_options
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the core's choice for the device).")
@weights_options
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--baseline-sample", type=click.IntRange(min=0), default=8, show_default=True,
              help="Requests decoded again without speculation to measure the speedup (0: off, speedup NULL).")
@max_tokens_option
@click.option("--temperature", type=click.FloatRange(min=0.0, max=2.0), default=0.0, show_default=True,
              help="For lines without temperature (0 = greedy).")
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
    from ..jobs import create_job_from_file, run_job, validate_file, write_results
    from ..jobs.export import OutputPathError, check_output_path
    from ..settings import get_settings

    meta = parse_metadata(metadata)
    settings = get_settings()
    target = target or settings.default_target
    draft = draft or settings.default_draft
    if output is None:
        stem = file.name[: -len(".jsonl")] if file.name.endswith(".jsonl") else file.stem
        output = Path.cwd() / f"{stem}.results.jsonl"
    defaults = {"max_new_tokens": max_tokens, "temperature": temperature}
    # Everything that can be checked without the model is checked before it loads.
    try:
        check_output_path(output, input_path=file, force=force)
        parsed = validate_file(file, defaults)
    except (OutputPathError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    factory = open_store_or_exit()
    console = _console(stderr=True)
    job_options = dict(output_file=output, batch_size=batch_size, baseline_sample=baseline_sample,
                       sampling_defaults=defaults, metadata=meta or None, report=parsed)
    if parsed.requests:
        # an unknown model fails before any job exists
        decoder = _load_decoder(target, draft, device, dtype, weights, draft_weights)
        job_id, parsed = create_job_from_file(factory, file, **_decoder_job_fields(decoder), **job_options)
    else:
        decoder = None
        job_id, parsed = create_job_from_file(factory, file, target=target, drafter=draft, **job_options)
    click.echo(job_id)
    console.print(f"job [bold]{job_id}[/]: {parsed.n_lines} request(s) from {file}, {len(parsed.errors)} invalid")
    _print_line_errors(parsed.errors, console)
    if parsed.requests:
        with _running(job_id) as display:
            run_job(factory, job_id, decoder, **display.hooks())
    else:
        write_results(factory, job_id, output)  # the errors file says why every line was refused
    _print_summary(factory, job_id)
    sys.exit(_exit_code(factory, job_id))


def _decoder_job_fields(decoder) -> dict:
    """The job row's fields that come from the loaded decoder: its models, limits and precision."""
    precision = getattr(decoder, "precision", None)  # None: a decoder not built by load_decoder
    return dict(
        target=decoder.target_name, drafter=decoder.draft_name, max_context=decoder.max_context,
        vocab_size=decoder.vocab_size, weights=precision.target.weights if precision else None,
        dtype=precision.target.dtype_name if precision else None,
    )


def _job_precision(factory, job_id: str, dtype: str | None) -> tuple[str | None, str | None]:
    """A job resumes at the precision it ran at (its stored weights and dtype); --dtype fills an older job's gap."""
    from ..store import queries

    with factory() as s:
        job = queries.get_job(s, job_id)
        return job.weights, job.dtype or dtype


@main.command("resume")
@click.argument("job")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: $SPEC_BATCH_DEVICE, else cpu).")
@click.option("--dtype", default=None, help="float32 | bfloat16 | float16.")
@click.option("--wait", "wait_busy", is_flag=True,
              help="When another live process holds some of the job's requests, wait until it lets them go "
                   "(it finishes, or dies and its lease expires) instead of exiting.")
def resume_command(job: str, device: str | None, dtype: str | None, wait_busy: bool) -> None:
    """Continue the interrupted job JOB (an id, a unique prefix, or "latest") with its target and drafter.

    A job submitted to the queue goes back to its workers; a local one continues in this process. Requests a
    live process holds are never taken over: resume names that process and exits (or waits, with --wait)."""
    from ..jobs import JobBusyError, JobStateError, resume
    from workers.enqueue import BrokerUnavailableError, enqueue_job

    factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(factory, job)
    console = _console(stderr=True)
    weights, dtype = _job_precision(factory, job_id, dtype)

    said: list[str] = []

    def on_wait(busy) -> None:
        if str(busy) not in said:  # once per holder, not once per poll
            said.append(str(busy))
            console.print(f"waiting: {busy}")

    try:
        with _running(job_id) as display:
            outcome = resume(
                factory, job_id,
                decoder_for=lambda target, drafter: _load_decoder(target, drafter, device, dtype, weights),
                enqueue=enqueue_job, wait=wait_busy, on_wait=on_wait,
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
    _print_summary(factory, job_id)
    sys.exit(EXIT_COMPLETED if outcome.action == "enqueued" else _exit_code(factory, job_id))


@main.command("jobs")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--status", type=click.Choice(JOB_STATUSES), default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job (the job_summary columns).")
def jobs_command(limit: int, status: str | None, as_json: bool) -> None:
    """Job history, newest first (from the job_summary view)."""
    from rich.table import Table

    from ..store import queries

    factory = open_store_or_exit(must_exist=True)
    with factory() as s:
        rows = queries.list_job_summaries(s, limit=limit, status=status)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r, default=str))
        return
    if not rows:
        _console().print("no jobs yet: [bold]spec-batch run FILE.jsonl[/] starts one")
        return
    from rich import box

    t = Table(title="Jobs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("job", no_wrap=True, min_width=max(len(r["job_id"]) for r in rows))
    t.add_column("status", no_wrap=True, min_width=11)
    for col in ("done/total", "failed", "acceptance", "tok/s", "speedup"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("created", no_wrap=True)
    t.add_column("target / drafter", overflow="fold")
    for r in rows:
        created = r["created_at"].astimezone().strftime("%m-%d %H:%M") if r["created_at"] else "—"
        t.add_row(
            r["job_id"], _status(r["status"]), f"{r['n_completed'] + r['n_failed']}/{r['n_requests']}",
            str(r["n_failed"]), _fmt(r["acceptance_rate"], ".0%"), _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup"], ".2f", "x"), created, f"{r['target']} / {r['drafter']}",
        )
    _console().print(t)


@main.command("show")
@click.argument("job")
@click.option("--errors", "n_errors", type=click.IntRange(min=0), default=10, show_default=True,
              help="How many failed requests to list.")
def show_command(job: str, n_errors: int) -> None:
    """Everything about one job: summary, settings, request counts, baseline and its first errors."""
    from rich.table import Table

    from ..store import queries

    factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(factory, job)
    _print_summary(factory, job_id, title=f"Job {job_id}")
    with factory() as s:
        j = queries.get_job(s, job_id)
        counts = queries.job_counts(s, job_id)
        failed = queries.failed_requests(s, job_id, n_errors)
    t = Table(show_header=False, title="Settings", title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("input file", j.input_file or "—")
    t.add_row("lines (invalid)", f"{j.n_requests} ({j.n_invalid})")
    t.add_row("requests by status", ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "—")
    t.add_row("batch size", str(j.batch_size))
    t.add_row("weights / dtype", f"{j.weights or 'full'} / {j.dtype or 'the device default'}")
    t.add_row("sampling defaults", json.dumps(j.sampling_defaults))
    t.add_row("metadata", json.dumps(j.user_metadata) if j.user_metadata else "—")
    if j.queue:
        t.add_row("queue / chunk size", f"{j.queue} / {j.chunk_size}")
    t.add_row("decode time", _fmt(j.decode_wall_s, ".1f", " s"))
    if j.baseline_wall_s is not None:
        t.add_row(
            "baseline sample",
            f"{j.baseline_requests} request(s): {j.sample_output_tokens} tokens in {j.sample_wall_s:.2f} s with "
            f"speculation, {j.baseline_output_tokens} in {j.baseline_wall_s:.2f} s without",
        )
    else:
        t.add_row("baseline sample", "off" if j.baseline_sample == 0 else "not measured yet")
    t.add_row("started / finalizing", f"{_when(j.started_at)} / {_when(j.finalizing_at)}")
    _console().print(t)
    if failed:
        e = Table(title="Failed requests", title_justify="left")
        for col in ("line", "custom_id", "code", "error"):
            e.add_column(col)
        for line, cid, code, err in failed:
            e.add_row(str(line), cid or "—", code or "—", err or "—")
        _console().print(e)


@main.command("results")
@click.argument("job")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Output JSONL; failed requests and invalid lines go to OUT.errors.jsonl beside it.")
@click.option("--force", is_flag=True, help="Replace OUT.jsonl (and OUT.errors.jsonl) if they exist.")
def results_command(job: str, output: Path, force: bool) -> None:
    """Export the results of JOB (OpenAI Batch API output lines)."""
    from ..jobs import job_info, write_results
    from ..jobs.export import OutputPathError, check_output_path

    factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(factory, job)
    try:
        check_output_path(output, input_path=job_info(factory, job_id).input_file, force=force)
        rep = write_results(factory, job_id, output)
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


@main.command("stats")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per target and drafter.")
def stats_command(as_json: bool) -> None:
    """Speedup and acceptance by target and drafter, over every job in the database."""
    from rich.table import Table

    from ..jobs.stats import stats_by_model

    factory = open_store_or_exit(must_exist=True)
    rows = stats_by_model(factory)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r, default=str))
        return
    if not rows:
        _console().print("no jobs yet")
        return
    from rich import box

    t = Table(title="By target and drafter", title_justify="left", box=box.SIMPLE_HEAD)
    for col, just in [("target", "left"), ("drafter", "left"), ("jobs", "right"), ("requests", "right"),
                      ("failed", "right"), ("out tokens", "right"), ("acceptance", "right"),
                      ("tok/step", "right"), ("mean tok/s", "right"), ("speedup (mean)", "right"),
                      ("min–max", "right"), ("jobs measured", "right")]:
        t.add_column(col, justify=just)
    for r in rows:
        rng = (f"{r['min_speedup']:.2f}–{r['max_speedup']:.2f}x" if r["min_speedup"] is not None else "—")
        t.add_row(
            r["target"], r["drafter"], str(r["jobs"]), str(r["n_requests"]), str(r["n_failed"]),
            str(r["output_tokens"]), _fmt(r["acceptance_rate"], ".1%"), _fmt(r["tokens_per_step"]),
            _fmt(r["tokens_per_s"], ".1f"), _fmt(r["speedup"], ".2f", "x"), rng, str(r["jobs_measured"]),
        )
    _console().print(t)


@main.group("db")
def db_group() -> None:
    """The job database's schema (Alembic migrations). URL: $SPEC_BATCH_DATABASE_URL."""


def _engine(url: str | None, *, create: bool = True):
    from ..store import make_engine

    mask_in_errors(click.get_current_context(), url)
    try:
        return make_engine(url, create=create)
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc


@db_group.command("upgrade")
@click.option("--url", default=None, help="Database URL (default: $SPEC_BATCH_DATABASE_URL or sqlite:///spec_batch.db).")
def db_upgrade(url: str | None) -> None:
    """Migrate the database to the newest schema (what `alembic upgrade head` does)."""
    from ..settings import shown_url
    from ..store import current_revision, migrate_to_head

    engine = _engine(url)
    shown = shown_url(engine.url.render_as_string(hide_password=False))
    try:
        before = current_revision(engine)
        head = migrate_to_head(engine)
    except Exception as exc:  # noqa: BLE001
        raise click.ClickException(f"cannot migrate {shown}: {exc}") from exc
    click.echo(f"{shown}: {before or '(empty)'} -> {head}" if before != head else f"{shown}: already at {head}")


@db_group.command("current")
@click.option("--url", default=None, help="Database URL (default: $SPEC_BATCH_DATABASE_URL).")
def db_current(url: str | None) -> None:
    """Show the database's revision and the newest one."""
    from ..store import current_revision, head_revision

    engine = _engine(url, create=False)
    click.echo(f"current: {current_revision(engine) or '(empty)'}  head: {head_revision()}")


@db_group.command("downgrade")
@click.argument("revision")
@click.option("--url", default=None, help="Database URL (default: $SPEC_BATCH_DATABASE_URL).")
@click.confirmation_option(prompt="Downgrading drops tables and their data. Continue?")
def db_downgrade(revision: str, url: str | None) -> None:
    """Downgrade the schema to REVISION ("base" drops everything spec-batch created)."""
    from ..store import downgrade

    downgrade(_engine(url, create=False), revision)
    click.echo(f"downgraded to {revision}")
