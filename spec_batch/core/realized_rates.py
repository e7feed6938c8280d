"""What a draft policy's plans realized at one batch size: tokens a second of the steps that drafted against those of
the steps that did not, and the margin drafting must beat plain decoding by there (core/policy.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RealizedRates:
    """Tokens a second that one batch size's steps realized, drafting and plain, as decayed sums, and the margin
    drafting must beat plain decoding by there (DraftPolicy.margin at least). Each drafting step whose evidence
    says drafting realized less than plain decoding raises the margin by `step` (up to `most`); each saying more
    lowers it back. Evidence: at least `evidence` tokens of each kind in the decayed sums."""

    margin: float
    drafted: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens, seconds
    plain: list[float] = field(default_factory=lambda: [0.0, 0.0])
    decay: float = 0.95
    step: float = 1.05
    most: float = 2.0
    evidence: float = 32.0

    def observe(self, drafted: bool, tokens: int, seconds: float, least: float) -> None:
        sums = self.drafted if drafted else self.plain
        sums[0] = sums[0] * self.decay + tokens
        sums[1] = sums[1] * self.decay + seconds
        if not drafted or min(self.drafted[0], self.plain[0]) < self.evidence or not self.plain[1] > 0:
            return
        ratio = (self.drafted[0] / self.drafted[1]) / (self.plain[0] / self.plain[1])
        # slow to raise (one bad spell of steps is noise), quicker to lower (drafting that pays again is wanted back)
        self.margin = min(self.most, self.margin * self.step) if ratio < 1.0 else max(least, self.margin / self.step**2)
