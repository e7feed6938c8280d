"""The report's charts: each function takes numbers from ``aggregate`` and returns one inline SVG.

Every chart says what it shows in its title and axis labels (with units), so it reads without the code.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import matplotlib.dates as mdates
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator, PercentFormatter

from .aggregate import BaselineRates, PositionAcceptance, RequestRates, ThroughputSeries
from .svg import figure, to_svg

SPEC = "#1f77b4"  # with speculation
PLAIN = "#9a9a9a"  # without speculation (the baseline)
PAID = "#2a9d4a"
NOT_PAID = "#d1495b"
REFERENCE = "#333333"


def acceptance_by_position(positions: Sequence[PositionAcceptance], chart_id: str) -> str:
    with figure() as fig:
        ax = fig.add_subplot()
        xs = [p.position for p in positions]
        rates = [p.rate or 0.0 for p in positions]
        bars = ax.bar(xs, rates, color=SPEC, width=0.7)
        for bar, p in zip(bars, positions):
            ax.annotate(
                f"{(p.rate or 0):.0%}\n{p.accepted:,}/{p.drafted:,}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_ylim(0, 1.18)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("position in the draft (1 = first drafted token of a step)")
        ax.set_ylabel("accepted / drafted (%)")
        ax.set_title("Acceptance rate by draft position")
        return to_svg(fig, chart_id)


def accepted_length_histogram(counts: Sequence[int], chart_id: str) -> str:
    total = sum(counts) or 1
    with figure() as fig:
        ax = fig.add_subplot()
        xs = list(range(len(counts)))
        shares = [c / total for c in counts]
        bars = ax.bar(xs, shares, color=SPEC, width=0.7)
        for bar, c in zip(bars, counts):
            ax.annotate(
                f"{c:,}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_ylim(0, max(shares, default=0) * 1.15 or 1)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft tokens accepted in the step (every step adds one more token from the target)")
        ax.set_ylabel("share of steps (%)")
        ax.set_title(f"Accepted draft tokens per step ({sum(counts):,} steps)")
        return to_svg(fig, chart_id)


def requests_paid(rates: Sequence[RequestRates], baseline_tokens_per_s: float | None, chart_id: str) -> str:
    """Tokens per step against tokens/s, one dot per request; which side of the baseline it landed on."""
    with figure() as fig:
        ax = fig.add_subplot()
        points = [r for r in rates if r.tokens_per_step is not None]
        if baseline_tokens_per_s is None:
            _dots(ax, points, SPEC, 0.7, "requests")
        else:
            _paid_and_lost(ax, points, baseline_tokens_per_s)
        ax.axvline(1.0, color=REFERENCE, linestyle=":", linewidth=1)
        ax.annotate(
            "1 token per step = plain decoding",
            (1.0, 0.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            ha="right",
            va="bottom",
            fontsize=8,
            xytext=(-3, 4),
            textcoords="offset points",
        )
        right = max([r.tokens_per_step or 1.0 for r in points] + [1.5])
        ax.set_xlim(0.8, right * 1.05)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tokens per step (output tokens / target forwards)")
        ax.set_ylabel("request tokens/s")
        title = "Which requests paid? One dot per request"
        if baseline_tokens_per_s is None:
            title += " (no baseline measured)"
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8)
        return to_svg(fig, chart_id)


def _dots(ax: Axes, points: Sequence[RequestRates], color: str, alpha: float, label: str) -> None:
    """One dot per request at (tokens per step, tokens/s); the legend counts them."""
    xs, ys = [r.tokens_per_step for r in points], [r.tokens_per_s for r in points]
    ax.scatter(xs, ys, s=14, color=color, alpha=alpha, label=f"{label} ({len(points):,})")


def _paid_and_lost(ax: Axes, points: Sequence[RequestRates], baseline_tokens_per_s: float) -> None:
    """The requests above the baseline's tokens/s in one colour, those below in another, and the baseline's line."""
    _dots(
        ax,
        [r for r in points if r.tokens_per_s >= baseline_tokens_per_s],
        PAID,
        0.75,
        "faster than without speculation",
    )
    _dots(
        ax,
        [r for r in points if r.tokens_per_s < baseline_tokens_per_s],
        NOT_PAID,
        0.75,
        "slower than without speculation",
    )
    ax.axhline(baseline_tokens_per_s, color=REFERENCE, linestyle="--", linewidth=1)
    ax.annotate(
        f"baseline: {baseline_tokens_per_s:.1f} tokens/s per request without speculation",
        (1.0, baseline_tokens_per_s),
        xycoords=("axes fraction", "data"),
        ha="right",
        va="bottom",
        fontsize=8,
        xytext=(-4, 2),
        textcoords="offset points",
    )


def throughput_over_time(series: ThroughputSeries, job_tokens_per_s: float | None, chart_id: str) -> str:
    span = series.bin_starts_s[-1] + series.bin_width_s
    unit, scale = ("h", 3600.0) if span > 3 * 3600 else ("min", 60.0) if span > 180 else ("s", 1.0)
    with figure() as fig:
        ax = fig.add_subplot()
        xs = [s / scale for s in series.bin_starts_s]
        ax.bar(
            xs,
            series.tokens_per_s,
            width=series.bin_width_s / scale,
            align="edge",
            color=SPEC,
            alpha=0.85,
            label="output tokens/s of the requests decoding in this interval",
        )
        if job_tokens_per_s is not None:
            ax.axhline(
                job_tokens_per_s,
                color=REFERENCE,
                linestyle="--",
                linewidth=1,
                label=f"job average: {job_tokens_per_s:.1f} tokens/s of decode time",
            )
        if series.baseline_window_s is not None:
            start, end = (t / scale for t in series.baseline_window_s)
            ax.axvspan(
                start,
                end,
                color=PLAIN,
                alpha=0.25,
                linewidth=0,
                label="baseline sample measured (with and without speculation; not in the bars)",
            )
        ax.set_xlim(0, span / scale)
        ax.set_ylim(bottom=0, top=max(series.tokens_per_s + [job_tokens_per_s or 0]) * 1.45 or 1)
        ax.set_xlabel(f"time since the first request started ({unit})")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"Throughput over the job's time ({series.bin_width_s:.3g} s bins)")
        ax.legend(loc="upper left", fontsize=8)
        return to_svg(fig, chart_id)


def baseline_by_request(pairs: Sequence[BaselineRates], chart_id: str) -> str:
    """Horizontal bar pairs: each sampled request's tokens/s without and with speculation."""
    height = max(2.4, 0.9 + 0.42 * len(pairs))
    with figure(height_in=height) as fig:
        ax = fig.add_subplot()
        ys = list(range(len(pairs)))
        base = [p.baseline_tokens_per_s or 0.0 for p in pairs]
        spec = [p.speculative_tokens_per_s or 0.0 for p in pairs]
        ax.barh([y - 0.2 for y in ys], spec, height=0.38, color=SPEC, label="with speculation")
        ax.barh([y + 0.2 for y in ys], base, height=0.38, color=PLAIN, label="without speculation")
        for y, p, s in zip(ys, pairs, spec):
            if p.speedup is not None:
                ax.annotate(
                    f"×{p.speedup:.2f}",
                    (s, y - 0.2),
                    va="center",
                    fontsize=8,
                    xytext=(3, 0),
                    textcoords="offset points",
                    color=PAID if p.speedup >= 1 else NOT_PAID,
                )
        ax.set_yticks(ys, [p.label for p in pairs], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(base + spec + [1.0]) * 1.18)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel("request tokens/s (same engine, same batch size)")
        ax.set_ylabel("sampled request (custom_id)")
        ax.set_title("Baseline sample, request by request (×: speedup)")
        ax.legend(loc="lower right", fontsize=8)
        return to_svg(fig, chart_id)


# Colours of the target/drafter pairs on the history page (matplotlib's tab10, then tab20's lighter shades).
PAIR_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
    "#dbdb8d",
    "#9edae5",
)


def pair_colours(labels: Sequence[str]) -> dict[str, str]:
    """One colour per target/drafter pair, the same in every chart of a page (pairs sorted, then cycled)."""
    return {label: PAIR_COLOURS[i % len(PAIR_COLOURS)] for i, label in enumerate(sorted(set(labels)))}


def history(
    series: dict[str, list[tuple[datetime, float]]],
    *,
    ylabel: str,
    title: str,
    chart_id: str,
    reference: float | None = None,
    reference_label: str = "",
    colours: dict[str, str] | None = None,
) -> str:
    """One colour per target/drafter pair (`colours`, shared by the page's charts): a dot per job at its
    creation time."""
    colours = colours or pair_colours(list(series))
    with figure(height_in=3.4 + 0.25 * ((len(series) + 1) // 2)) as fig:
        ax = fig.add_subplot()
        for label, points in sorted(series.items()):
            points = sorted(points)
            ax.plot(
                [t for t, _ in points],
                [v for _, v in points],
                marker="o",
                markersize=5,
                linewidth=1,
                label=label,
                color=colours[label],
            )
        if reference is not None:
            ax.axhline(reference, color=REFERENCE, linestyle="--", linewidth=1, label=reference_label)
        locator = mdates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        top = max([v for points in series.values() for _, v in points] + [reference or 0.0])
        ax.set_ylim(0, top * 1.15 or 1.0)
        ax.set_xlabel("job created (UTC)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(
            fontsize=8,
            title="target + drafter",
            title_fontsize=8,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.22),
            ncols=2,
        )
        return to_svg(fig, chart_id)
