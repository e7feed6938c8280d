"""`spec-batch wait`: a job's progress until it ends, then its status (and, with -o, its results); `spec-batch
cancel`, which can wait the same way."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from ..store.models import (
    JOB_CANCELLED,
    JOB_CANCELLING,
    JOB_COMPLETED,
    JOB_EXPIRED,
    JOB_FAILED,
    JOB_TERMINAL,
    REQ_CANCELLED,
    REQ_COMPLETED,
    REQ_FAILED,
    REQ_PENDING,
    REQ_RUNNING,
    REQUEST_DONE,
)
from ._common import (
    EXIT_CANCELLED,
    EXIT_COMPLETED,
    EXIT_EXPIRED,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    open_store_or_exit,
    resolve_job,
)
from ._group import main

JOB_EXIT_CODES = {
    JOB_COMPLETED: EXIT_COMPLETED,
    JOB_FAILED: EXIT_FAILED,
    JOB_CANCELLED: EXIT_CANCELLED,
    JOB_EXPIRED: EXIT_EXPIRED,
}


def err(msg: str) -> None:
    click.echo(msg, err=True)


def _progress_line(job_id: str, status: str, counts: dict[str, int], total: int, rate: float | None) -> str:
    done = sum(counts[s] for s in REQUEST_DONE)
    parts = [f"job {job_id} {status}: {done}/{total} done", f"{counts[REQ_COMPLETED]} completed"]
    if counts[REQ_FAILED]:
        parts.append(f"{counts[REQ_FAILED]} failed")
    if counts[REQ_CANCELLED]:
        parts.append(f"{counts[REQ_CANCELLED]} cancelled")
    parts.append(f"{counts[REQ_RUNNING]} running, {counts[REQ_PENDING]} pending")
    if rate:
        parts.append(f"{rate:.2f} req/s")
    return ", ".join(parts)


def wait_for_job(
    session_factory, job_id: str, *, interval: float, timeout: float | None, output: Path | None, quiet: bool
) -> int:
    from ..store import queries

    t0 = time.monotonic()
    last_line = None
    first_done = None
    tty = sys.stderr.isatty()
    while True:
        with session_factory() as s:
            job = queries.get_job(s, job_id)
            status, total = job.status, job.n_requests
            counts = queries.job_counts(s, job_id)
        done = sum(counts[s] for s in REQUEST_DONE)
        elapsed = time.monotonic() - t0
        if first_done is None:
            first_done = done
        rate = (done - first_done) / elapsed if elapsed > 1 and done > first_done else None
        line = _progress_line(job_id, status, counts, total, rate)
        if not quiet and line != last_line:
            if tty:
                click.echo("\r\033[K" + line, err=True, nl=False)
            else:
                err(line)
            last_line = line
        if status in JOB_TERMINAL:
            break
        if timeout is not None and elapsed > timeout:
            if tty and not quiet:
                err("")
            err(f"timed out after {timeout:.0f}s; job {job_id} is {status}")
            return EXIT_TIMEOUT
        time.sleep(interval)
    if tty and not quiet:
        err("")
    if not quiet:
        _print_outcome(session_factory, job_id)
    if output is not None and status != JOB_FAILED:
        _write_output(session_factory, job_id, output)
    click.echo(status)
    return JOB_EXIT_CODES.get(status, EXIT_FAILED)


def _print_outcome(session_factory, job_id: str) -> None:
    """The ended job's rates and its error, if any, on stderr."""
    from ..store import queries, summaries

    with session_factory() as s:
        row = summaries.job_summary_row(s, job_id) or {}
        error = queries.get_job(s, job_id).error
    stats = []
    for key, label, fmt in (
        ("tokens_per_s", "tokens/s", ".1f"),
        ("acceptance_rate", "acceptance", ".3f"),
        ("tokens_per_step", "tokens/step", ".2f"),
        ("speedup", "speedup", ".2f"),
    ):
        if row.get(key) is not None:
            stats.append(f"{label} {row[key]:{fmt}}")
    if stats:
        err("  " + ", ".join(stats))
    if error:
        err(f"  error: {error}")


def _write_output(session_factory, job_id: str, output: Path) -> None:
    from ..jobs import write_results

    try:
        rep = write_results(session_factory, job_id, output)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from exc
    err(
        f"  wrote {rep.n_output} result(s) to {rep.output_path}"
        + (f" and {rep.n_errors} error(s) to {rep.errors_path}" if rep.errors_path else "")
    )


@main.command("wait")
@click.argument("job")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between progress checks.",
)
@click.option("--timeout", type=click.FloatRange(min=0), default=None, help="Give up after this many seconds (exit 3).")
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path),  # a folder is the output guard's refusal (exit 1), not a usage error
    default=None,
    help="When the job ends, write its results here (and OUT.errors.jsonl), as `spec-batch results`.",
)
@click.option("--force", is_flag=True, help="With -o: replace OUT.jsonl (and OUT.errors.jsonl) if they exist.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines; only the final status on stdout.")
def wait_command(
    job: str, interval: float, timeout: float | None, output: Path | None, force: bool, quiet: bool
) -> None:
    """Show JOB's progress until it ends; prints its final status. Exit 0 completed, 1 failed, 2 cancelled,
    3 timed out."""
    from ..jobs import job_info
    from ..jobs.output_guard import OutputPathError, check_output_path, job_files

    session_factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(session_factory, job)
    if output is not None:  # checked now, not after a long wait
        try:
            check_output_path(
                output,
                input_path=job_info(session_factory, job_id).input_file,
                protected=job_files(session_factory, [job_id]),
                force=force,
            )
        except OutputPathError as exc:
            raise click.ClickException(str(exc)) from exc
    sys.exit(wait_for_job(session_factory, job_id, interval=interval, timeout=timeout, output=output, quiet=quiet))


# ---------------------------------------------------------------- cancel


@main.command("cancel")
@click.argument("job")
@click.option("--wait", "wait_after", is_flag=True, help="Then wait until the job is cancelled.")
def cancel_command(job: str, wait_after: bool) -> None:
    """Cancel JOB: no new chunk starts, running chunks stop at their next decoding step, finished requests stay.

    The job is `cancelling` until no request runs any more, then `cancelled`; requests that never ran are
    `cancelled` (they are in the errors file of `spec-batch results`).
    """
    from ..jobs import JobStateError, cancel_job

    session_factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(session_factory, job)
    try:
        outcome = cancel_job(session_factory, job_id)
    except JobStateError as exc:
        raise click.ClickException(str(exc)) from exc
    err(
        f"job {job_id}: {outcome.status} ({outcome.running} request(s) still running stop at their next decoding step)"
        if outcome.status == JOB_CANCELLING
        else f"job {job_id}: {outcome.status}"
    )
    click.echo(outcome.status)
    if wait_after and outcome.status == JOB_CANCELLING:
        code = wait_for_job(session_factory, job_id, interval=0.5, timeout=None, output=None, quiet=False)
        sys.exit(EXIT_COMPLETED if code == EXIT_CANCELLED else code)
