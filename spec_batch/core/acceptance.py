"""What a draft policy remembers of acceptance: each row's own record (`RowAcceptance`: its first draft token's
chance, whether it is copying, and what its drafts delivered of what the plans expected) and the run lengths shared
by a decoder's rows (`DepthSurvival`). core/policy.py turns them into acceptance chances and draft lengths."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowAcceptance:
    """One row's chance to get the first draft token of a step accepted, from decayed counts. How far a run goes
    once started is the shared DepthSurvival's business; the drafter sets the prior (Drafter.initial_acceptance)."""

    first_hits: float = 1.0  # the first draft token accepted, out of ...
    first_tries: float = 2.0  # ... steps that offered one (prior 1/2)
    decay: float = 0.9
    last_hit: bool = field(init=False)  # the last checked first token was accepted (the row is copying)
    # decayed draft tokens this row's plans expected to get accepted, and how many were (prior 1 of 1): the shared
    # calibration's promise checked against this row's own record (`trust`)
    promised: float = 1.0
    delivered: float = 1.0
    _pending: float = field(default=0.0, init=False)  # what the step in flight expects (promise)

    def __post_init__(self) -> None:
        self.last_hit = self.first >= 0.5  # before any evidence the prior decides

    def promise(self, expected: float) -> None:
        """The step being planned expects this many of the row's draft tokens accepted."""
        self._pending = expected

    def deliver(self, accepted: int) -> None:
        """The step accepted this many of the row's draft tokens (after its promise; none promised: no evidence)."""
        if self._pending > 0:
            self.promised = self.promised * self.decay + self._pending
            self.delivered = self.delivered * self.decay + accepted
        self._pending = 0.0

    @property
    def trust(self) -> float:
        """What this row's accepted drafts came to, as a share of what the plans expected (at most 1): a row whose
        drafts the calibration overrates (a prompt that offers text to copy the output does not copy) is held to
        its own record where one row's slowness matters (DraftPolicy.latency_slack)."""
        return min(1.0, self.delivered / self.promised)

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
