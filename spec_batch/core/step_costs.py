"""What a step costs: the clock that says so (StepClock: the wall clock by default, chosen costs in tests), and
what the policy remembers of it: seconds of a whole step by batch size and verify width (StepCosts), and the same
where a padded position may cost less than a real token (PaddedCosts). The draft policy (core/policy.py) weighs
expected tokens against these; it never reads a clock itself, so a test that hands it chosen costs is exact."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class StepClock(Protocol):
    """How a running batch learns what its steps cost: `start()` before a step (or before a drafter grows a tree),
    then `step(...)` / `growth(...)` with what it did, which return the seconds the policy records."""

    def start(self) -> float: ...

    def step(self, started: float, rows: int, lengths: Sequence[int]) -> float:
        """The seconds of a step of `rows` rows that verified lengths[b] draft tokens (a tree's nodes) per row."""

    def growth(self, started: float, forwards: int) -> float:
        """The seconds of one drafter forward of a tree grown with `forwards` of them."""

    def lookup(self, started: float, rows: int) -> float:
        """The seconds of a free drafter's lookups and the policy's plan for a step of `rows` rows."""


class WallClock:
    """What a step took on this machine: the decoder's clock unless it is given another."""

    def start(self) -> float:
        return time.perf_counter()

    def step(self, started: float, rows: int, lengths: Sequence[int]) -> float:
        return time.perf_counter() - started

    def growth(self, started: float, forwards: int) -> float:
        return (time.perf_counter() - started) / forwards

    def lookup(self, started: float, rows: int) -> float:
        return time.perf_counter() - started


WALL_CLOCK = WallClock()
PRIOR_TOKEN_SHARE = 0.05  # what one more token per row costs, as a share of a step, before anything says otherwise


@dataclass
class StepCosts:
    """Measured seconds of a whole step, by (batch size, input width = 1 + longest draft), as moving averages."""

    seconds: dict[tuple[int, float], float] = field(default_factory=dict)
    smoothing: float = 0.3
    # each batch size's (width, seconds), sorted, and what one more token costs in plain steps (`_token_floor`),
    # derived once after each observation: estimate runs for every candidate plan of every step
    _by_batch: dict[int, list[tuple[float, float]]] | None = field(default=None, init=False, repr=False)
    _per_token: float | None = field(default=None, init=False, repr=False)

    def observe(self, batch: int, width: float, seconds: float, replace: bool = False) -> None:
        """replace: the measurement supersedes the average (a probe's, of a width not measured for a while: what the
        machine's load was then says nothing of now)."""
        key = (batch, width)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None or replace else old + self.smoothing * (seconds - old)
        self._by_batch = None

    def _measured(self) -> dict[int, list[tuple[float, float]]]:
        if self._by_batch is None:
            by_batch: dict[int, list[tuple[float, float]]] = {}
            for (b, w), s in sorted(self.seconds.items()):
                by_batch.setdefault(b, []).append((w, s))
            self._by_batch = by_batch
            self._per_token = _plain_slope([(b, points[0][1]) for b, points in by_batch.items() if points[0][0] == 1])
        return self._by_batch

    def estimate(self, batch: int, width: float) -> float | None:
        """Measured, else interpolated/extrapolated linearly in width from this batch size's measurements. A batch
        size with fewer than two widths measured (a job's tail, as rows finish) takes its shape from the nearest
        batch size that has two, scaled to its own measurement if it has one: the policy compares widths at one
        batch size, so it needs their relative costs, which a measured shape gives better than a made-up prior
        (docs/core.md); and never less than its plain step plus its extra tokens at plain steps' cost a token
        (`_token_floor`). None: nothing measured at all."""
        measured = self.seconds.get((batch, width))
        if measured is not None:
            return measured
        known = self._measured().get(batch, [])
        if len(known) < 2:
            guess, floor = self._borrowed(batch, width, known), self._token_floor(batch, width)
            return guess if guess is None or floor is None else max(guess, floor)
        below = [p for p in known if p[0] < width]
        above = [p for p in known if p[0] > width]
        if below and above:
            (w1, s1), (w2, s2) = below[-1], above[0]  # interpolate
        elif below:
            (w1, s1), (w2, s2) = known[-2], known[-1]  # extrapolate past the widest measured
        else:
            (w1, s1), (w2, s2) = known[0], known[1]  # extrapolate below the narrowest measured
        slope = max(0.0, (s2 - s1) / (w2 - w1))
        return max(1e-6, s1 + slope * (width - w1))

    def _borrowed(self, batch: int, width: float, known: list[tuple[float, float]]) -> float | None:
        """A batch size with fewer than two widths of its own: the nearest shaped batch size's costs (scaled to its
        own measurement if it has one), else the prior from its one measurement."""
        by_batch = self._measured()
        shaped = [b for b, points in by_batch.items() if len(points) >= 2 and b != batch]
        if shaped:
            nearest = min(shaped, key=lambda b: (abs(b - batch), -b))  # ties: the larger (costlier widths)
            if not known:
                return self.estimate(nearest, width)
            w0, s0 = known[0]
            return s0 * self.estimate(nearest, width) / self.estimate(nearest, w0)  # type: ignore[operator]
        if not known:
            return None
        w0, s0 = known[0]
        # nothing to take the shape from: a prior of PRIOR_TOKEN_SHARE of a step per extra token per row, which
        # the next measurement of another width replaces
        return s0 * max(PRIOR_TOKEN_SHARE, 1.0 + PRIOR_TOKEN_SHARE * (width - w0))

    def _token_floor(self, batch: int, width: float) -> float | None:
        """The least a width not measured at this batch size is taken to cost: its plain step plus its extra tokens
        (batch * (width - 1)) at what one more token costs in plain steps, the slope of their seconds against the
        batch size (least squares over the batch sizes measured, at least 0). Where a step is bound by arithmetic
        (wide batches) a draft token costs about what a row's token does, and a shape borrowed from a narrower batch
        size, bound by reading the weights, would promise wide steps nearly free. None: this batch size's plain step
        not measured, or no two batch sizes a factor 2 apart."""
        plain = self.seconds.get((batch, 1.0))
        self._measured()  # derives _per_token
        if plain is None or self._per_token is None:
            return None
        return plain + self._per_token * batch * (width - 1.0)


def _plain_slope(points: list[tuple[int, float]]) -> float | None:
    """Plain steps' seconds against their batch size (least squares, at least 0): what one more token costs. None
    without two batch sizes a factor 2 apart: sizes close together (a bulk job's first rows leaving) give noise."""
    sizes = [b for b, _ in points]
    if not sizes or max(sizes) < 2 * min(sizes):
        return None
    mean_b = sum(sizes) / len(points)
    mean_s = sum(s for _, s in points) / len(points)
    spread = sum((b - mean_b) ** 2 for b in sizes)
    return max(0.0, sum((b - mean_b) * (s - mean_s) for b, s in points) / spread)


class PaddedCosts:
    """Step costs where a padded position may cost less than a real token, and how much is measured.

    A step of batch b drafting lengths ks computes b * (1 + mean) real tokens and b * (max - mean) padded ones.
    Where the target skips padding in its linear layers (core/kv/padding.py) a padded position still costs
    something (attention and the elementwise layers run on the padded width), how much depends on the machine and
    the model (docs/core.md). So a step's cost is read from a StepCosts table at the effective width
    u = 1 + mean + rho * (max - mean), for candidate weights rho of a padded position (0: free, 1: as dear as a real
    token, the dense case). Every table is updated on every step; the one whose predictions erred least lately is
    used. A single rho would be wrong somewhere: keyed on the mean alone (rho 0), one long row's padding reads as the
    price of drafting at all, and the policy stops drafting for the rest of a job."""

    RHOS = (0.0, 0.25, 0.5, 1.0)

    def __init__(self, ragged: bool, error_decay: float = 0.95):
        self.tables = {rho: StepCosts() for rho in (self.RHOS if ragged else (1.0,))}
        self.errors = {rho: 0.0 for rho in self.tables}  # decayed squared log errors of each table's predictions
        self.error_decay = error_decay

    @classmethod
    def fixed(cls, table: StepCosts) -> PaddedCosts:
        """Given costs by verify width (a replay's, not measured here): a padded position costs a real token's."""
        costs = cls(ragged=False)
        costs.tables[1.0] = table
        return costs

    @staticmethod
    def width(rho: float, lengths: list[int]) -> float:
        """The effective verify width of a step drafting these lengths (quarter steps: nearby plans share a key)."""
        if not lengths:
            return 1.0
        longest, mean = max(lengths), sum(lengths) / len(lengths)
        return 1.0 + round((mean + rho * (longest - mean)) * 4) / 4

    @property
    def rho(self) -> float:
        return min(self.tables, key=lambda r: (self.errors[r], -r))  # ties: the dearer padding (the safe side)

    def estimate(self, batch: int, lengths: list[int]) -> float | None:
        rho = self.rho
        return self.tables[rho].estimate(batch, self.width(rho, lengths))

    def estimates(self, batch: int) -> Callable[[list[int]], float | None]:
        """`estimate` at this batch size for the many plans of one step: the table chosen once, each effective
        width looked up once (nothing is observed between the calls)."""
        rho = self.rho
        table, seen = self.tables[rho], {}

        def estimate(lengths: list[int]) -> float | None:
            width = self.width(rho, lengths)
            if width not in seen:
                seen[width] = table.estimate(batch, width)
            return seen[width]

        return estimate

    def observe(self, batch: int, lengths: list[int], seconds: float, replace: bool = False) -> None:
        for rho, table in self.tables.items():
            width = self.width(rho, lengths)
            predicted = table.estimate(batch, width)
            if predicted is not None and len(self.tables) > 1:
                self.errors[rho] = self.errors[rho] * self.error_decay + math.log(seconds / predicted) ** 2
            table.observe(batch, width, seconds, replace=replace and width > 1.0)

    def observe_width(self, batch: int, width: float, seconds: float) -> None:
        """A step in which every row read `width` tokens (no padding: every table's key is the width)."""
        for table in self.tables.values():
            table.observe(batch, width, seconds)
