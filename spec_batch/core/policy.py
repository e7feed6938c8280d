"""How many tokens to draft next.

Each step the policy compares, for every candidate draft length k, the tokens the step is expected to yield
(from each row's observed acceptance) with what a step of that width is measured to cost at this batch size,
and picks the best rate. k = 0 is plain decoding, so speculation switches itself off where it does not pay
(low acceptance, or a batch so large that verifying k + 1 tokens per row costs nearly k + 1 plain steps).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowAcceptance:
    """One row's chance to get the first draft token of a step accepted, from decayed counts. How far a run goes
    once started is the shared DepthSurvival's business; the drafter sets the prior (Drafter.initial_acceptance)."""

    first_hits: float = 1.0  # the first draft token accepted, out of ...
    first_tries: float = 2.0  # ... steps that offered one (prior 1/2)
    decay: float = 0.9

    def observe(self, accepted: int, rejected: bool) -> None:
        """A step accepted `accepted` draft tokens; rejected: a draft token was turned down (not only run out)."""
        if accepted > 0 or rejected:
            self.first_hits = self.first_hits * self.decay + (1.0 if accepted > 0 else 0.0)
            self.first_tries = self.first_tries * self.decay + 1.0

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


def expected_tokens(alpha: float, k: int, continuation: list[float] | None = None) -> float:
    """Expected tokens from one step with k draft tokens: accepted run + the target's own token.

    Without `continuation` the run is geometric in alpha. With it, alpha is the row's chance to accept the
    first token and continuation[j] the shared chance that a run that started reaches token j + 1."""
    if k <= 0:
        return 1.0
    if continuation is not None:
        return 1.0 + alpha * sum(continuation[:k])
    if alpha >= 0.999999:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class StepCosts:
    """Measured seconds of a whole step, by (batch size, input width = 1 + longest draft), as moving averages."""

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    smoothing: float = 0.3

    def observe(self, batch: int, width: int, seconds: float) -> None:
        key = (batch, width)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def estimate(self, batch: int, width: int) -> float | None:
        """Measured, else interpolated/extrapolated linearly in width from this batch size's measurements."""
        if (batch, width) in self.seconds:
            return self.seconds[(batch, width)]
        known = sorted((w, s) for (b, w), s in self.seconds.items() if b == batch)
        if not known:
            return None
        if len(known) == 1:
            w0, s0 = known[0]
            # optimistic prior: each extra token per row costs 5% of a step; measuring it corrects this
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


class DraftPolicy:
    def __init__(self, k_max: int = 8, adaptive: bool = True, candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16)):
        if k_max < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k_max}")
        self.k_max = k_max
        self.adaptive = adaptive
        self.candidates = sorted({c for c in candidates if c <= k_max} | {k_max})
        self.costs = StepCosts()
        self.probe_every = 32
        self._idle_steps = 0

    def choose(
        self,
        batch: int,
        alphas: list[float],
        available: list[int],
        continuation: list[float] | None = None,
        probe: bool = True,
    ) -> int:
        """The draft length for this step. available[b]: tokens the drafter can offer row b (after budget caps).
        probe=False: never draft just to measure acceptance (a free drafter's proposals are checked anyway)."""
        longest = max(available, default=0)
        if longest == 0 or self.k_max == 0:
            return 0
        if not self.adaptive:
            return min(self.k_max, longest)
        k = self._best(batch, alphas, available, longest, continuation)
        if k == 0:
            # acceptance is only observed while drafting: probe now and then, so a drafter that starts to pay
            # (the output began copying the prompt) is noticed
            self._idle_steps += 1
            if probe and self.probe_every and self._idle_steps >= self.probe_every:
                self._idle_steps = 0
                return min(longest, 2)
        else:
            self._idle_steps = 0
        return k

    def _best(
        self, batch: int, alphas: list[float], available: list[int], longest: int, continuation: list[float] | None
    ) -> int:
        best_k, best_rate = 0, -1.0
        for k in sorted({min(c, longest) for c in self.candidates}):
            width = 1 + k
            cost = self.costs.estimate(batch, width)
            if cost is None:  # nothing measured at this batch size yet: start from a middling draft
                return min(longest, max(1, self.k_max // 2))
            tokens = sum(expected_tokens(a, min(k, n), continuation) for a, n in zip(alphas, available))
            rate = tokens / cost
            if rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        return best_k

    def observe_step(self, batch: int, width: int, seconds: float) -> None:
        self.costs.observe(batch, width, seconds)
