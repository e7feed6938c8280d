"""What a report page holds, built from the store's report data: summaries, charts (inline SVG) and tables."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from markupsafe import Markup

from ..store.report_queries import JobReportData
from . import aggregate, charts

TABLE_ROWS = 10  # slowest and least-accepted requests listed per job


@dataclass(frozen=True)
class Chart:
    key: str  # what the chart is (a CSS class; tests find charts by it)
    heading: str
    caption: str  # one sentence on how to read it
    svg: Markup | None  # None: nothing to draw, `caption` says why


@dataclass(frozen=True)
class Table:
    heading: str
    columns: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class JobSection:
    job_id: str
    summary: list[tuple[str, str]]
    charts: list[Chart]
    tables: list[Table]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Page:
    title: str
    generated_at: str
    intro: str
    overview: Table | None = None
    jobs: list[JobSection] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


def fmt(value: float | int | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "—"
    return f"{value:{spec}}{suffix}"


def fmt_time(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "—"


def _summary(data: JobReportData) -> list[tuple[str, str]]:
    s = data.summary
    baseline = (
        f"{fmt(s.get('baseline_tokens_per_s'), '.1f', ' tokens/s')} without speculation "
        f"({data.baseline_requests} request(s) sampled)"
        if data.baseline_requests
        else ("off" if data.baseline_sample == 0 else "not measured yet")
    )
    return [
        ("status", str(s.get("status", "—"))),
        ("target", str(s.get("target", "—"))),
        ("drafter", str(s.get("drafter", "—"))),
        ("requests", f"{s.get('n_requests', 0)} ({s.get('n_completed', 0)} completed, {s.get('n_failed', 0)} failed)"),
        ("output tokens", f"{s.get('output_tokens', 0):,}"),
        ("acceptance rate", fmt(s.get("acceptance_rate"), ".1%")),
        ("tokens per step", fmt(s.get("tokens_per_step"), ".2f")),
        ("tokens/s", fmt(s.get("tokens_per_s"), ".1f")),
        ("baseline", baseline),
        ("speedup", _speedup(s)),
        ("batch size", str(data.batch_size)),
        ("decode time", fmt(data.decode_wall_s, ".1f", " s")),
        ("created / completed", f"{fmt_time(s.get('created_at'))} / {fmt_time(s.get('completed_at'))}"),
    ]


def _speedup(s: dict) -> str:
    """The speedup with its interleaved rounds' range; job_summary's speedup_reliable says when it is unreliable."""
    text = fmt(s.get("speedup"), ".2f", "×")
    low, high = s.get("speedup_low"), s.get("speedup_high")
    if s.get("speedup") is None or low is None or high is None:
        return text
    text += f" (rounds {low:.2f}×–{high:.2f}×)"
    if s.get("speedup_reliable") is False:
        text += ": unreliable, the rounds differ by more than 25% of it (the load changed while it was measured)"
    return text


def _request_table(heading: str, rows: Sequence[aggregate.RequestRates]) -> Table:
    return Table(
        heading,
        ["custom_id", "line", "output tokens", "seconds", "tokens/s", "tokens per step", "acceptance"],
        [
            [
                r.custom_id or "—",
                str(r.line_number),
                f"{r.output_tokens:,}",
                fmt(r.wall_s, ".2f"),
                fmt(r.tokens_per_s, ".1f"),
                fmt(r.tokens_per_step, ".2f"),
                fmt(r.acceptance_rate, ".0%"),
            ]
            for r in rows
        ],
    )


def chart(key: str, heading: str, caption: str, draw: Callable[[], str] | None, empty: str) -> Chart:
    """A chart drawn by `draw`, or, when there is nothing to draw (draw is None), a box that says why."""
    if draw is None:
        return Chart(key, heading, empty, None)
    return Chart(key, heading, caption, Markup(draw()))


def job_section(data: JobReportData) -> JobSection:
    rates = aggregate.request_rates(data.requests)
    return JobSection(
        job_id=data.job_id,
        summary=_summary(data),
        charts=_job_charts(data, rates),
        tables=[
            _request_table(
                f"Slowest requests (lowest tokens/s, {TABLE_ROWS} at most)", aggregate.slowest(rates, TABLE_ROWS)
            ),
            _request_table(
                f"Least-accepted requests (lowest acceptance rate, {TABLE_ROWS} at most)",
                aggregate.least_accepted(rates, TABLE_ROWS),
            ),
        ],
        notes=[f"job error: {data.error}"] if data.error else [],
    )


def _job_charts(data: JobReportData, rates: list[aggregate.RequestRates]) -> list[Chart]:
    positions = aggregate.acceptance_by_position(data.requests)
    lengths = aggregate.accepted_length_counts(data.requests)
    series = aggregate.throughput_over_time(data.requests, {b.request_id for b in data.baseline})
    pairs = aggregate.baseline_rates(data.baseline)
    base_tps = aggregate.baseline_request_tokens_per_s(data.baseline)
    job_tps = data.summary.get("tokens_per_s")
    cid = data.job_id + "-"
    return [
        chart(
            "acceptance-by-position",
            "Acceptance rate by draft position",
            "Bar labels: accepted / drafted steps. A step drafts up to k tokens, and position j can only be "
            "accepted when positions 1..j-1 were: where the bars drop, longer drafts stop paying.",
            (lambda: charts.acceptance_by_position(positions, cid + "positions")) if positions else None,
            "No per-position counts are stored for this job (it drafted nothing, or ran before they were recorded).",
        ),
        chart(
            "accepted-length",
            "Accepted length per step",
            "Bar labels: steps. How many draft tokens the target accepted in each step; 0 means the step gave "
            "only the target's own token, as plain decoding would.",
            (lambda: charts.accepted_length_histogram(lengths, cid + "lengths")) if lengths else None,
            "No step statistics are stored for this job yet.",
        ),
        chart(
            "requests-paid",
            "Which requests paid",
            "Right of the dotted line, a request made more than one token per target forward; above the dashed "
            "line, it ran faster than the baseline sample's requests ran without speculation.",
            (lambda: charts.requests_paid(rates, base_tps, cid + "paid")) if rates else None,
            "No request has finished with timings yet.",
        ),
        chart(
            "throughput",
            "Throughput over time",
            "Each request's output tokens spread over the time it was decoding, per second of wall time; gaps "
            "are times the job was not decoding (queued, stopped, between resumes) or measured its baseline.",
            (lambda: charts.throughput_over_time(series, job_tps, cid + "throughput")) if series else None,
            "Fewer than two requests have finished.",
        ),
        chart(
            "baseline",
            "Baseline sample, request by request",
            "The job's speedup is measured on this sample: the same requests decoded with and without "
            "speculation, with the same engine and batch size.",
            (lambda: charts.baseline_by_request(pairs, cid + "baseline")) if pairs else None,
            "No per-request baseline is stored for this job (the baseline was off, not measured yet, or measured "
            "before per-request pairs were recorded); the speedup above comes from the job's totals.",
        ),
    ]


def _overview(datas: Sequence[JobReportData]) -> Table:
    columns = ["job", "status", "target", "drafter", "requests", "acceptance", "tokens per step", "tokens/s", "speedup"]
    rows = []
    for d in datas:
        s = d.summary
        rows.append(
            [
                d.job_id,
                str(s.get("status")),
                str(s.get("target")),
                str(s.get("drafter")),
                str(s.get("n_requests", 0)),
                fmt(s.get("acceptance_rate"), ".1%"),
                fmt(s.get("tokens_per_step"), ".2f"),
                fmt(s.get("tokens_per_s"), ".1f"),
                fmt(s.get("speedup"), ".2f", "×"),
            ]
        )
    return Table("Jobs in this report", columns, rows)


def jobs_page(datas: Sequence[JobReportData], *, now: datetime) -> Page:
    ids = ", ".join(d.job_id for d in datas)
    return Page(
        title=f"spec-batch report: {ids}",
        generated_at=fmt_time(now),
        intro="Speculative decoding statistics of bulk jobs, from the job database.",
        overview=_overview(datas) if len(datas) > 1 else None,
        jobs=[job_section(d) for d in datas],
    )


def history_page(rows: Sequence[dict[str, Any]], *, now: datetime, since: datetime | None) -> Page:
    """Jobs over time from ``job_summary`` rows (oldest first)."""
    speedups: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    rates: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    for r in rows:
        label = f"{r['target']} + {r['drafter']}"
        if r.get("speedup") is not None:
            speedups[label].append((r["created_at"], r["speedup"]))
        if r.get("tokens_per_s") is not None:
            rates[label].append((r["created_at"], r["tokens_per_s"]))
    colours = charts.pair_colours([*speedups, *rates])  # a pair has one colour on the whole page
    chart_list = [
        chart(
            "history-speedup",
            "Speedup per job",
            "Measured speedup of each job (its sample with speculation over the same sample without); above the "
            "dashed line speculation paid.",
            (
                lambda: charts.history(
                    speedups,
                    ylabel="speedup (×)",
                    title="Speedup per job over time",
                    chart_id="history-speedup",
                    reference=1.0,
                    reference_label="no gain (1×)",
                    colours=colours,
                )
            )
            if speedups
            else None,
            "No job in this period measured a baseline.",
        ),
        chart(
            "history-tokens-per-s",
            "Tokens/s per job",
            "Output tokens per second of each job's decode time.",
            (
                lambda: charts.history(
                    rates,
                    ylabel="output tokens/s",
                    title="Throughput per job over time",
                    chart_id="history-tokens-per-s",
                    colours=colours,
                )
            )
            if rates
            else None,
            "No job in this period produced tokens.",
        ),
    ]
    period = f"since {fmt_time(since)}" if since is not None else "all jobs"
    return Page(
        title="spec-batch job history",
        generated_at=fmt_time(now),
        intro=f"{len(rows)} job(s), {period}, coloured by target and drafter.",
        charts=chart_list,
        tables=[_history_table(rows)],
    )


def _history_table(rows: Sequence[dict[str, Any]]) -> Table:
    """Every job of the period, newest first."""
    return Table(
        "Jobs",
        [
            "created",
            "job",
            "status",
            "target",
            "drafter",
            "requests",
            "acceptance",
            "tokens per step",
            "tokens/s",
            "speedup",
        ],
        [
            [
                fmt_time(r["created_at"]),
                r["job_id"],
                str(r["status"]),
                str(r["target"]),
                str(r["drafter"]),
                str(r["n_requests"]),
                fmt(r.get("acceptance_rate"), ".1%"),
                fmt(r.get("tokens_per_step"), ".2f"),
                fmt(r.get("tokens_per_s"), ".1f"),
                fmt(r.get("speedup"), ".2f", "×"),
            ]
            for r in reversed(rows)
        ],
    )
