"""How the job commands print: status colours, number and time formats, the job_summary table."""

from __future__ import annotations

from typing import Any

from ..store.models import (
    JOB_CANCELLED,
    JOB_CANCELLING,
    JOB_COMPLETED,
    JOB_EXPIRED,
    JOB_FAILED,
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    JOB_VALIDATING,
)

STATUS_STYLE = {
    JOB_COMPLETED: "green",
    JOB_IN_PROGRESS: "yellow",
    JOB_VALIDATING: "yellow",
    JOB_FINALIZING: "yellow",
    JOB_FAILED: "red",
    JOB_CANCELLING: "magenta",
    JOB_CANCELLED: "magenta",
    JOB_EXPIRED: "magenta",
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


def _summary_table(row: dict, title: str):
    from rich.table import Table

    from ..jobs.baseline import describe_speedup

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
    t.add_row(
        "speedup (measured)",
        describe_speedup(row["speedup"], row.get("speedup_low"), row.get("speedup_high"), row.get("speedup_reliable")),
    )
    t.add_row("created / completed", f"{_when(row['created_at'])} / {_when(row['completed_at'])}")
    return t


def _print_summary(session_factory, job_id: str, *, title: str = "Job summary") -> dict:
    from ..jobs.batch_output import errors_path_for
    from ..store import queries, summaries

    with session_factory() as s:
        row = summaries.job_summary_row(s, job_id)
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
