"""Numbers a report shows, computed from the store's plain report data (no drawing, no SQL).

Every rate is RequestStats' (spec_batch.core.outputs: the one definition of acceptance rate, tokens per step and
tokens/s). A request's seconds are its own time inside its batch (admission to finish), so request rates
compare with each other, not with a job's aggregate tokens/s.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from ..core.outputs import RequestStats
from ..store.report_queries import BaselinePoint, RequestPoint


def _tokens_per_s(output_tokens: int | None, wall_s: float | None) -> float | None:
    return RequestStats(output_tokens=output_tokens or 0, wall_s=wall_s or 0.0).tokens_per_s


def _add_into(total: list[int], counts: Sequence[int] | None) -> None:
    if not counts:
        return
    if len(total) < len(counts):
        total.extend([0] * (len(counts) - len(total)))
    for i, c in enumerate(counts):
        total[i] += int(c or 0)


@dataclass(frozen=True)
class PositionAcceptance:
    position: int  # 1 = the first drafted token of a step
    drafted: int  # steps that proposed a token at this position
    accepted: int  # steps in which the target accepted it

    @property
    def rate(self) -> float | None:
        """The acceptance rate of this position alone."""
        return RequestStats(draft_tokens=self.drafted, accepted_tokens=self.accepted).acceptance_rate


def acceptance_by_position(requests: Sequence[RequestPoint]) -> list[PositionAcceptance]:
    """Per draft position, summed over the job's requests; empty when no request stored position counts."""
    drafted: list[int] = []
    accepted: list[int] = []
    for r in requests:
        _add_into(drafted, r.drafted_per_position)
        _add_into(accepted, r.accepted_per_position)
    accepted.extend([0] * (len(drafted) - len(accepted)))
    return [PositionAcceptance(j + 1, d, accepted[j]) for j, d in enumerate(drafted) if d > 0]


def accepted_length_counts(requests: Sequence[RequestPoint]) -> list[int]:
    """counts[a] = steps in which exactly `a` draft tokens were accepted, over the job's requests."""
    total: list[int] = []
    for r in requests:
        _add_into(total, r.accepted_length_histogram)
    while total and total[-1] == 0:
        total.pop()
    return total


@dataclass(frozen=True)
class RequestRates:
    """One finished request's rates (only requests that produced tokens in measured time)."""

    custom_id: str | None
    line_number: int
    output_tokens: int
    wall_s: float
    tokens_per_step: float | None
    acceptance_rate: float | None  # None: nothing was drafted
    tokens_per_s: float

    @property
    def label(self) -> str:
        return self.custom_id or f"line {self.line_number}"


def request_rates(requests: Sequence[RequestPoint]) -> list[RequestRates]:
    out = []
    for r in requests:
        stats = RequestStats(
            output_tokens=r.output_tokens or 0,
            draft_tokens=r.draft_tokens or 0,
            accepted_tokens=r.accepted_tokens or 0,
            target_forwards=r.target_forwards or 0,
            wall_s=r.wall_s or 0.0,
        )
        if not stats.output_tokens or stats.tokens_per_s is None:
            continue
        out.append(
            RequestRates(
                custom_id=r.custom_id,
                line_number=r.line_number,
                output_tokens=stats.output_tokens,
                wall_s=stats.wall_s,
                tokens_per_step=stats.tokens_per_step,
                acceptance_rate=stats.acceptance_rate,
                tokens_per_s=stats.tokens_per_s,
            )
        )
    return out


def slowest(rates: Sequence[RequestRates], n: int) -> list[RequestRates]:
    """The n requests with the lowest tokens/s."""
    return sorted(rates, key=lambda r: (r.tokens_per_s, r.line_number))[:n]


def least_accepted(rates: Sequence[RequestRates], n: int) -> list[RequestRates]:
    """The n requests with the lowest acceptance rate (requests that drafted nothing are left out)."""
    drafted = [r for r in rates if r.acceptance_rate is not None]
    return sorted(drafted, key=lambda r: (r.acceptance_rate, r.line_number))[:n]


@dataclass(frozen=True)
class BaselineRates:
    """One sampled request: tokens/s with and without speculation (same engine, same batch size)."""

    label: str
    speculative_tokens_per_s: float | None
    baseline_tokens_per_s: float | None

    @property
    def speedup(self) -> float | None:
        spec, base = self.speculative_tokens_per_s, self.baseline_tokens_per_s
        return spec / base if spec is not None and base else None


def baseline_rates(points: Sequence[BaselinePoint]) -> list[BaselineRates]:
    return [
        BaselineRates(
            label=p.custom_id or f"line {p.line_number}",
            speculative_tokens_per_s=_tokens_per_s(p.speculative_output_tokens, p.speculative_wall_s),
            baseline_tokens_per_s=_tokens_per_s(p.baseline_output_tokens, p.baseline_wall_s),
        )
        for p in points
    ]


def baseline_request_tokens_per_s(points: Sequence[BaselinePoint]) -> float | None:
    """A request's tokens/s without speculation, pooled over the baseline sample (tokens over seconds)."""
    return _tokens_per_s(sum(p.baseline_output_tokens for p in points), sum(p.baseline_wall_s for p in points))


@dataclass(frozen=True)
class ThroughputSeries:
    """Output tokens per second of wall time, in equal time bins (seconds since the job's first request started)."""

    bin_starts_s: list[float]
    bin_width_s: float
    tokens_per_s: list[float]
    baseline_window_s: tuple[float, float] | None  # when the baseline sample was measured (not in the bins)


def _seconds(t: datetime, t0: datetime) -> float:
    return (t - t0).total_seconds()


def throughput_over_time(
    requests: Sequence[RequestPoint], baseline_ids: Collection[int] = (), bins: int = 40
) -> ThroughputSeries | None:
    """Each finished request's output tokens spread evenly over its own decode interval (started_at to
    completed_at; a request without a start counts at its completion), summed per time bin.

    The baseline sample's requests are left out of the bins: their rows span the whole measurement (claimed
    before, stored after decoding the sample twice), which is returned as a window instead. None when fewer
    than two requests finished (no time span to draw)."""
    done = [r for r in requests if r.completed_at is not None and r.output_tokens]
    if len(done) < 2:
        return None
    t0 = min(r.started_at or r.completed_at for r in done)  # type: ignore[type-var]
    sample = [r for r in done if r.request_id in baseline_ids]
    window = None
    if sample:
        window = (
            min(_seconds(r.started_at or r.completed_at, t0) for r in sample),  # type: ignore[arg-type]
            max(_seconds(r.completed_at, t0) for r in sample),
        )  # type: ignore[arg-type]
    spans = []
    for r in done:
        if r.request_id in baseline_ids:
            continue
        end = _seconds(r.completed_at, t0)  # type: ignore[arg-type]
        start = _seconds(r.started_at, t0) if r.started_at is not None else end
        spans.append((min(start, end), end, float(r.output_tokens or 0)))
    total_s = max([end for _, end, _ in spans] + [window[1] if window else 0.0])
    if total_s <= 0:
        return None
    width = total_s / bins
    tokens = [0.0] * bins
    for start, end, n in spans:
        if end - start <= 0:
            tokens[min(bins - 1, int(end / width))] += n
            continue
        rate = n / (end - start)
        first, last = int(start / width), min(bins - 1, int(end / width))
        for b in range(first, last + 1):
            overlap = min(end, (b + 1) * width) - max(start, b * width)
            if overlap > 0:
                tokens[b] += rate * overlap
    return ThroughputSeries([i * width for i in range(bins)], width, [t / width for t in tokens], window)
