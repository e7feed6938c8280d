"""What a drafter's stated confidence is worth: observed acceptance against stated confidence, learned per
drafter kind (one calibration per decoder, and a decoder has one drafter kind).

A count-based confidence says how often a continuation followed the matched context before, not how often the
target will agree now: a continuation seen once states 1.0. Calibration turns it into P(draft token accepted |
the draft tokens before it were accepted), in bins of stated confidence, kept apart for:
- a step's first draft token when the row's previous first token was accepted (the row is copying: bursty),
- a step's first draft token otherwise (a new row, or one whose last proposal missed),
- every later draft token (given the ones before it were accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_AFTER_HIT, FIRST_AFTER_MISS, LATER = 0, 1, 2


def _prior_scale() -> list[float]:
    # before any evidence: trust a copying row's and a later token's confidence, halve a cold first token's
    return [1.0, 0.5, 1.0]


def calibration_kind(later: bool, after_hit: bool) -> int:
    """Which calibration a draft token's confidence goes through (a later token, or a first one after a hit/miss)."""
    return LATER if later else (FIRST_AFTER_HIT if after_hit else FIRST_AFTER_MISS)


@dataclass
class ConfidenceCalibration:
    bins: int = 10
    decay: float = 0.995  # per observation of a bin: recent behaviour counts most
    prior_strength: float = 2.0  # pseudo-observations at the prior
    prior_scale: list[float] = field(default_factory=_prior_scale)
    hits: list[list[float]] = field(default_factory=list)
    tries: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hits = [[0.0] * self.bins for _ in range(3)]
        self.tries = [[0.0] * self.bins for _ in range(3)]

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def rate(self, kind: int, confidence: float) -> float:
        """Calibrated P(accepted) of a draft token with this stated confidence: the bin's observations, shrunk
        towards its stated confidence times what the kind's stated confidence has turned out to be worth overall
        (`scale`). A bin seldom observed (a head's confident deeper nodes: their parents are seldom accepted) takes
        its kind's measured worth, not the confidence at face value."""
        b = self._bin(confidence)
        prior = min(1.0, (b + 0.5) / self.bins * self.scale(kind))
        return (self.hits[kind][b] + self.prior_strength * prior) / (self.tries[kind][b] + self.prior_strength)

    def scale(self, kind: int) -> float:
        """Observed acceptances over stated confidence, over every bin of a kind (prior_scale before evidence)."""
        stated = sum(t * (b + 0.5) / self.bins for b, t in enumerate(self.tries[kind]))
        return (sum(self.hits[kind]) + self.prior_strength * self.prior_scale[kind]) / (stated + self.prior_strength)

    def observe(self, kind: int, confidence: float, accepted: bool) -> None:
        b = self._bin(confidence)
        self.hits[kind][b] = self.hits[kind][b] * self.decay + (1.0 if accepted else 0.0)
        self.tries[kind][b] = self.tries[kind][b] * self.decay + 1.0

    def observe_run(self, after_hit: bool, confidence: list[float], run: int, checked: int) -> None:
        """A proposal with these per-token confidences matched the target's tokens for `run` tokens, out of
        `checked` compared (a run shorter than checked ended in a rejection; beyond it nothing is known)."""
        for j in range(min(run + 1, checked, len(confidence))):
            kind = calibration_kind(j > 0, after_hit)
            self.observe(kind, confidence[j], j < run)

    def accept_probs(self, after_hit: bool, confidence: list[float]) -> list[float]:
        """Calibrated conditional acceptance of each proposed token."""
        return [self.rate(calibration_kind(j > 0, after_hit), c) for j, c in enumerate(confidence)]
