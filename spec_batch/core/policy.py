"""How many tokens each row drafts next, and so the batch's verify width.

Each row's offer is turned into acceptance chances q[j] = P(draft token j accepted | the ones before it were):
from the drafter's per-token confidence, calibrated per drafter kind (ConfidenceCalibration), or, for drafters
without one, from the row's first-token acceptance and the shared run-length curve (DepthSurvival). Drafting
j tokens then yields 1 + sum_{i<j} prod_{l<=i} q[l] tokens in expectation (`expected_tokens`). A row stops
where its chance to get that far falls below `min_reach`, so a low-confidence row drafts nothing while others
draft 16. For each candidate width the step yields the rows' expected tokens at that width and costs what a step
of that width is measured to cost at this batch size (every row pays the width: short rows waste padding); the
best tokens per second wins. Width 1 is plain decoding, so speculation switches itself off where it does not pay;
drafting must beat it by a margin (10%), since a wrong "on" costs a step and the estimates are noisy. Switched off,
it keeps probing (a small, shrinking share of steps), and a probe's measured cost replaces the stale one: step costs
measured in a busy spell must not lock speculation off once the machine is quiet again.

Where the target skips padded positions (`ragged`: core/padding.py; the packed CPU linears), a step costs what
its real tokens cost, not its width: then each row drafts its own length. A row drafts token j while its chance
to get there is at least a threshold shared by the batch; the threshold with the best expected tokens per
second wins. Its cost is looked up at an effective width between 1 + the mean draft (padding free) and 1 + the
longest (padding as dear as a real token), weighted by what a padded position is measured to cost (PaddedCosts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .calibration import ConfidenceCalibration


@dataclass
class RowAcceptance:
    """One row's chance to get the first draft token of a step accepted, from decayed counts. How far a run goes
    once started is the shared DepthSurvival's business; the drafter sets the prior (Drafter.initial_acceptance)."""

    first_hits: float = 1.0  # the first draft token accepted, out of ...
    first_tries: float = 2.0  # ... steps that offered one (prior 1/2)
    decay: float = 0.9
    last_hit: bool = field(init=False)  # the last checked first token was accepted (the row is copying)

    def __post_init__(self) -> None:
        self.last_hit = self.first >= 0.5  # before any evidence the prior decides

    def observe(self, accepted: int, rejected: bool) -> None:
        """A step accepted `accepted` draft tokens; rejected: a draft token was turned down (not only run out)."""
        if accepted > 0 or rejected:
            self.first_hits = self.first_hits * self.decay + (1.0 if accepted > 0 else 0.0)
            self.first_tries = self.first_tries * self.decay + 1.0
            self.last_hit = accepted > 0

    @property
    def first(self) -> float:
        """P(the first draft token of a step is accepted), this row's own."""
        return self.first_hits / self.first_tries


@dataclass
class DepthSurvival:
    """How far accepted runs go, shared by the rows of a decoder: hazard[j] = P(draft token j+1 rejected |
    the first j accepted), from decayed counts. Copying is bursty (a run that got going tends to go on), which a
    single per-row alpha underrates; scaling by this curve lets long drafts win where runs really are long."""

    depth: int = 32
    decay: float = 0.995
    reached: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [2.0] * self.depth  # prior at every depth: one rejection in two
        self.rejected = [1.0] * self.depth

    def observe(self, offered: int, accepted: int) -> None:
        """A row was offered `offered` tokens and accepted the first `accepted` (< offered means a rejection)."""
        if offered <= 0:
            return
        self.reached = [r * self.decay for r in self.reached]
        self.rejected = [r * self.decay for r in self.rejected]
        for j in range(min(accepted + 1, offered, self.depth)):
            self.reached[j] += 1.0
        if accepted < offered and accepted < self.depth:
            self.rejected[accepted] += 1.0

    def continuation(self, k: int) -> list[float]:
        """c[j] = P(run >= j + 1 | run >= 1) for j = 0..k-1 (c[0] = 1)."""
        out, alive = [], 1.0
        for j in range(k):
            out.append(alive)
            if j + 1 < self.depth:
                alive *= 1.0 - self.rejected[j + 1] / self.reached[j + 1]
        return out


def expected_tokens(accept_probs: list[float], k: int) -> float:
    """Expected tokens from one step drafting the first k of a proposal: the accepted run + the target's token."""
    total, alive = 1.0, 1.0
    for q in accept_probs[:k]:
        alive *= q
        total += alive
    return total


def _gains(accept_probs: list[float], min_reach: float) -> list[float]:
    """g[j] = expected accepted tokens when drafting j; stops where the chance to get that far < min_reach."""
    gains, alive = [0.0], 1.0
    for q in accept_probs:
        alive *= q
        if alive < min_reach:
            break
        gains.append(gains[-1] + alive)
    return gains


@dataclass
class StepCosts:
    """Measured seconds of a whole step, by (batch size, input width = 1 + longest draft), as moving averages."""

    seconds: dict[tuple[int, float], float] = field(default_factory=dict)
    smoothing: float = 0.3
    # each batch size's (width, seconds), sorted: estimate runs for every candidate plan of every step
    _by_batch: dict[int, list[tuple[float, float]]] | None = field(default=None, init=False, repr=False)

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
        return self._by_batch

    def estimate(self, batch: int, width: float) -> float | None:
        """Measured, else interpolated/extrapolated linearly in width from this batch size's measurements. A batch
        size with fewer than two widths measured (a job's tail, as rows finish) takes its shape from the nearest
        batch size that has two, scaled to its own measurement if it has one: the policy compares widths at one
        batch size, so it needs their relative costs, and a CPU's first draft token can cost 15-30% of a step
        (more than a made-up prior would say). None: nothing measured at all."""
        measured = self.seconds.get((batch, width))
        if measured is not None:
            return measured
        by_batch = self._measured()
        known = by_batch.get(batch, [])
        if len(known) < 2:
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
            # nothing to take the shape from: each extra token per row costs 5% of a step; measuring corrects it
            return s0 * max(0.05, 1.0 + 0.05 * (width - w0))
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


class PaddedCosts:
    """Step costs where a padded position may cost less than a real token, and how much is measured.

    A step of batch b drafting lengths ks computes b * (1 + mean) real tokens and b * (max - mean) padded ones.
    Where the target skips padding in its linear layers (core/padding.py) a padded position still costs
    something (attention and the elementwise layers run on the padded width): measured on the default model at
    batch 8 on a CPU, a row drafting 16 beside seven drafting nothing cost as much as every row drafting 4. So a
    step's cost is read from a StepCosts table at the effective width u = 1 + mean + rho * (max - mean), for
    candidate weights rho of a padded position (0: free, 1: as dear as a real token, the dense case). Every
    table is updated on every step; the one whose predictions erred least lately is used. Keying on the mean
    alone (rho 0) mistook one long row's padding for the price of drafting at all: the policy stopped drafting
    for the rest of a job."""

    RHOS = (0.0, 0.25, 0.5, 1.0)

    def __init__(self, ragged: bool, error_decay: float = 0.95):
        self.tables = {rho: StepCosts() for rho in (self.RHOS if ragged else (1.0,))}
        self.errors = {rho: 0.0 for rho in self.tables}  # decayed squared log errors of each table's predictions
        self.error_decay = error_decay

    @classmethod
    def fixed(cls, table: StepCosts) -> "PaddedCosts":
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


class DraftPolicy:
    def __init__(
        self,
        k_max: int = 8,
        adaptive: bool = True,
        candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16),
        min_reach: float = 0.05,
        ragged: bool = False,
        margin: float = 1.1,
        tree_width: int = 1,
        tree_batch: int = 1,
    ):
        if k_max < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k_max}")
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.k_max = k_max
        self.adaptive = adaptive
        # a drafter that grows trees (a head: core/head_drafter.py) drafts k + width - 1 nodes of depth k in batches of
        # at most tree_batch rows (1: a verify forward at batch 1 is bound by reading the weights, so extra nodes
        # cost little there; at larger batches every node is paid in compute). 1: chains. Depth k is planned as for a
        # chain, and a tree step's cost and accepted run are recorded under its depth.
        self.tree_width = tree_width
        self.tree_batch = tree_batch
        self.candidates = sorted({c for c in candidates if c <= k_max} | {k_max})
        self.min_reach = min_reach
        self.ragged = ragged  # a step costs its real tokens (the target skips padding), not its width
        # drafting must beat plain decoding's expected rate by this much: the estimates are noisy, and a wrong
        # "on" costs a whole step (a CPU's first draft token costs 15-35% of one), a wrong "off" a few tokens
        self.margin = margin
        # learned across calls (the workload's): step costs, run lengths, what stated confidence is worth
        self.costs = PaddedCosts(ragged)
        self.survival = DepthSurvival(depth=max(1, k_max) + 1)
        self.calibration = ConfidenceCalibration()
        # probes while drafting is off. A costly drafter probes acceptance every probe_every idle steps. A free drafter's
        # acceptance is observed anyway, but the cost of a drafted step is only measured while drafting: a busy spell
        # that inflated it would lock speculation off for good (issue 23, item 9). So where an offer has a chance
        # (a plan that drafts exists), its best drafting plan is tried after cost_probe_first idle steps, then after
        # twice as many each time it did not pay, up to probe_every; the probe's measured cost replaces the stale one.
        self.probe_every = 32
        self.cost_probe_first = 8
        self._cost_probe_every = self.cost_probe_first
        self._idle_steps = 0
        self._probing = False  # the planned step is a probe: its measured cost replaces the stale one
        # while drafting, every explore_every-th step drafts one token more per row than the best plan: a width's
        # cost is only measured where it is drafted, and step times vary by +-10% run to run, so a width measured
        # once in a slow moment was never tried again (tests/core/test_policy.py shows the lock-in; on the default
        # model's head at batch 1 the exploration measured neither a gain nor a cost: docs/benchmarks.md)
        self.explore_every = 8
        self._drafting_steps = 0

    def tree_width_for(self, batch: int) -> int:
        return self.tree_width if batch <= self.tree_batch else 1

    def accept_probs(self, acceptance: RowAcceptance, n: int, confidence: list[float] | None = None) -> list[float]:
        """q[j] for the first n tokens of a row's proposal (confidence: the drafter's, per token, if it has one)."""
        if n <= 0:
            return []
        if confidence is not None:
            return self.calibration.accept_probs(acceptance.last_hit, list(confidence[:n]))
        c = self.survival.continuation(n)
        return [acceptance.first] + [c[j] / c[j - 1] if c[j - 1] > 0 else 0.0 for j in range(1, n)]

    def plan(self, batch: int, offers: list[list[float]], probe: bool = True) -> list[int]:
        """Each row's draft length this step. offers[b]: accept_probs of what row b can be offered (after budget
        caps). probe=True (a costly drafter): while off, draft 2 tokens every probe_every steps to measure acceptance.
        probe=False (a free drafter: its proposals are checked anyway): while off, try the best drafting plan now and
        then (see __init__) to re-measure what drafting costs, only where an offer has a chance."""
        self._probing = False
        if self.k_max == 0 or not any(offers):
            return [0] * len(offers)
        if not self.adaptive:
            return [min(self.k_max, len(q)) for q in offers]
        if self.costs.estimate(batch, [0]) is None:
            # nothing measured yet: a plain step first, the cost every draft length is weighed against (drafting
            # first left the policy with one drafted width and a guess for plain decoding: a cold start drafted
            # 4 tokens per row at 25% acceptance, 20% slower than plain on a CPU at batch 8)
            return [0] * len(offers)
        gains = [_gains(q[: self.k_max], self.min_reach) for q in offers]
        ks = self._best_plan(batch, gains, drafting=False)
        if any(ks):
            self._idle_steps = 0
            self._cost_probe_every = self.cost_probe_first
            self._drafting_steps += 1
            if self.explore_every and self._drafting_steps % self.explore_every == 0:
                ks = [min(k + 1, len(g) - 1) for k, g in zip(ks, gains)]
            return ks
        self._idle_steps += 1
        if probe and self.probe_every and self._idle_steps >= self.probe_every:
            # acceptance is only observed while drafting: probe now and then, so a drafter that starts to pay (the
            # output began copying the prompt) is noticed
            self._idle_steps = 0
            self._probing = True
            return [min(2, len(q)) for q in offers]
        if not probe and self._idle_steps >= self._cost_probe_every:
            ks = self._best_plan(batch, gains, drafting=True)  # all zeros where no row has a chance
            if any(ks):
                self._idle_steps = 0
                self._cost_probe_every = min(2 * self._cost_probe_every, max(self.cost_probe_first, self.probe_every))
                self._probing = True
                return ks
        return [0] * len(offers)

    def _best_plan(self, batch: int, gains: list[list[float]], drafting: bool) -> list[int]:
        """Each row's length by expected tokens per second; drafting=True: the best plan that drafts at all."""
        if self.ragged:
            return self._best_lengths(batch, gains, drafting)
        lengths = [len(g) - 1 for g in gains]
        k = self._best_width(batch, gains, max(lengths), drafting) - 1
        return [min(k, n) for n in lengths]

    def _best_width(self, batch: int, gains: list[list[float]], longest: int, drafting: bool = False) -> int:
        if longest == 0:
            return 1
        best_width, best_rate = 1, -1.0
        for k in sorted({min(c, longest) for c in self.candidates} - ({0} if drafting else set())):
            cost = self.costs.estimate(batch, [k])
            tokens = sum(1.0 + g[min(k, len(g) - 1)] for g in gains)
            rate = tokens / cost * (self.margin if k == 0 else 1.0)  # type: ignore[operator]
            if rate > best_rate * 1.0001:
                best_width, best_rate = 1 + k, rate
        return best_width

    def _best_lengths(self, batch: int, gains: list[list[float]], drafting: bool = False) -> list[int]:
        """Per-row lengths when a step costs its real tokens: row b drafts token j while the chance to reach it
        (gains[b][j] - gains[b][j - 1], falling with j) is >= a threshold; the best threshold wins."""
        reach = [[g[j] - g[j - 1] for j in range(1, len(g))] for g in gains]
        best, best_rate = [0] * len(gains), -1.0
        thresholds = ([] if drafting else [float("inf")]) + sorted({p for r in reach for p in r}, reverse=True)
        for threshold in thresholds:
            ks = [sum(1 for p in r if p >= threshold) for r in reach]
            cost = self.costs.estimate(batch, ks)
            rate = sum(1.0 + g[k] for g, k in zip(gains, ks)) / cost  # type: ignore[operator]
            rate *= self.margin if not any(ks) else 1.0
            if rate > best_rate * 1.0001:
                best, best_rate = ks, rate
        return best

    def observe_row(self, acceptance: RowAcceptance, confidence: list[float] | None, run: int, checked: int) -> None:
        """A row's proposal matched the step's emitted tokens for `run` tokens of the `checked` compared."""
        if checked <= 0:
            return
        if confidence is not None:
            self.calibration.observe_run(acceptance.last_hit, confidence, run, checked)
        acceptance.observe(run, rejected=run < checked)
        self.survival.observe(checked, run)

    def observe_step(self, batch: int, lengths: list[int], seconds: float) -> None:
        """A step of `batch` rows drafting these lengths took `seconds` (the step plan() planned last)."""
        self.costs.observe(batch, lengths, seconds, replace=self._probing)
        self._probing = False
