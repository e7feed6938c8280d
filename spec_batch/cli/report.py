"""`spec-batch report`: one self-contained HTML page of jobs' charts, or of every job over time."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import click

from ._common import open_store_or_exit, resolve_job
from ._group import main


def parse_since(value: str) -> datetime:
    """A date or an ISO 8601 time; without a UTC offset it is UTC."""
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a date: give YYYY-MM-DD or an ISO 8601 time (2026-05-01T12:00, 2026-05-01T12:00+02:00)",
            param_hint="--since",
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


@main.command("report")
@click.argument("jobs", nargs=-1)
@click.option("--history", is_flag=True, help="Every job over time (speedup and tokens/s) instead of given jobs.")
@click.option(
    "--since",
    "since",
    default=None,
    metavar="DATE",
    help="With --history: jobs created at or after DATE (YYYY-MM-DD or ISO 8601; UTC unless it says).",
)
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path),  # a folder is the output guard's refusal (exit 1), not a usage error
    required=True,
    help="The HTML file to write (self-contained: open it anywhere, offline).",
)
@click.option(
    "--force", is_flag=True, help="Replace OUTPUT if it exists (never a job's input, results or errors file)."
)
def report_command(jobs: tuple[str, ...], history: bool, since: str | None, output: Path, force: bool) -> None:
    """An HTML report of JOB [JOB...] (ids, unique prefixes or "latest"): summary, acceptance by draft
    position, accepted lengths, which requests paid, throughput over time, the baseline sample, and the
    slowest and least-accepted requests. With --history: speedup and tokens/s of every job over time."""
    from ..jobs.output_guard import OutputPathError, write_text_atomically
    from ..reports import history_report_html, job_report_html

    if history and jobs:
        raise click.UsageError("give JOB ids or --history, not both")
    if not history and not jobs:
        raise click.UsageError('give at least one JOB id (or "latest"), or --history')
    if since is not None and not history:
        raise click.UsageError("--since goes with --history")
    since_at = parse_since(since) if since is not None else None
    session_factory = open_store_or_exit(must_exist=True)
    ids = list(dict.fromkeys(resolve_job(session_factory, ref) for ref in jobs))  # each job once, in the order given
    try:
        _check_output(session_factory, output, ids, force)
    except OutputPathError as exc:
        raise click.ClickException(str(exc)) from exc
    with session_factory() as s:
        html = history_report_html(s, since=since_at) if history else job_report_html(s, ids)
    try:
        write_text_atomically(output, html)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from exc
    click.echo(f"report -> {output} ({len(html.encode()) / 1024:.0f} KiB)")


def _check_output(session_factory, output: Path, ids: list[str], force: bool) -> None:
    """The output guard of every writing command, before any chart is drawn: never a file of the jobs reported
    (with --history: of any job), never a device or a FIFO, an existing file only with --force."""
    from ..jobs.output_guard import check_folder, check_target, job_files
    from ..store import summaries

    if not ids:  # --history: every job may be on the page
        with session_factory() as s:
            ids = [r["job_id"] for r in summaries.list_job_summaries(s, limit=None)]
    check_target(output, protected=job_files(session_factory, ids, outputs=True), force=force)
    check_folder(output)
