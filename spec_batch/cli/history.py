"""`spec-batch jobs | show | stats`: the job history in SQL (the job_summary view), read only."""

from __future__ import annotations

import json

import click

from ..store.models import JOB_STATUSES
from ._common import open_store_or_exit, resolve_job
from ._group import main
from ._job_display import _console, _fmt, _print_summary, _status, _when


@main.command("jobs")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--status", type=click.Choice(JOB_STATUSES), default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job (the job_summary columns).")
def jobs_command(limit: int, status: str | None, as_json: bool) -> None:
    """Job history, newest first (from the job_summary view)."""
    from rich.table import Table

    from ..store import summaries

    session_factory = open_store_or_exit(must_exist=True)
    with session_factory() as s:
        rows = summaries.list_job_summaries(s, limit=limit, status=status)
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
            r["job_id"],
            _status(r["status"]),
            f"{r['n_completed'] + r['n_failed']}/{r['n_requests']}",
            str(r["n_failed"]),
            _fmt(r["acceptance_rate"], ".0%"),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup"], ".2f", "x"),
            created,
            f"{r['target']} / {r['drafter']}",
        )
    _console().print(t)


@main.command("show")
@click.argument("job")
@click.option(
    "--errors",
    "n_errors",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="How many failed requests to list.",
)
def show_command(job: str, n_errors: int) -> None:
    """Everything about one job: summary, settings, request counts, baseline and its first errors."""
    from rich.table import Table

    from ..store import queries

    session_factory = open_store_or_exit(must_exist=True)
    job_id = resolve_job(session_factory, job)
    _print_summary(session_factory, job_id, title=f"Job {job_id}")
    with session_factory() as s:
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


@main.command("stats")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per target and drafter.")
def stats_command(as_json: bool) -> None:
    """Speedup and acceptance by target and drafter, over every job in the database."""
    from rich.table import Table

    from ..jobs.stats import stats_by_model

    session_factory = open_store_or_exit(must_exist=True)
    rows = stats_by_model(session_factory)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r, default=str))
        return
    if not rows:
        _console().print("no jobs yet")
        return
    from rich import box

    t = Table(title="By target and drafter", title_justify="left", box=box.SIMPLE_HEAD)
    for col, just in [
        ("target", "left"),
        ("drafter", "left"),
        ("jobs", "right"),
        ("requests", "right"),
        ("failed", "right"),
        ("out tokens", "right"),
        ("acceptance", "right"),
        ("tok/step", "right"),
        ("mean tok/s", "right"),
        ("speedup (mean)", "right"),
        ("min–max", "right"),
        ("jobs measured", "right"),
    ]:
        t.add_column(col, justify=just)
    for r in rows:
        rng = f"{r['min_speedup']:.2f}–{r['max_speedup']:.2f}x" if r["min_speedup"] is not None else "—"
        t.add_row(
            r["target"],
            r["drafter"],
            str(r["jobs"]),
            str(r["n_requests"]),
            str(r["n_failed"]),
            str(r["output_tokens"]),
            _fmt(r["acceptance_rate"], ".1%"),
            _fmt(r["tokens_per_step"]),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup"], ".2f", "x"),
            rng,
            str(r["jobs_measured"]),
        )
    _console().print(t)
