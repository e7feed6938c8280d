"""How often a draft policy looks at a free drafter's offers while drafting is off (core/policy.py `consults`).

Looking costs Python time per row (the suffix index's lookups, the policy's plan: ~1 ms of a 17 ms plain step at 8
rows on a 2-core CPU), paid on every step whether anything is drafted or not. While drafting is off, the offers are
looked at every n-th step, n such that looking costs at most `share` of a plain step on average (n <= `most`); a
step that does not look decodes plainly. At one row a look costs ~1% of a step: every step looks there; at 8-16
rows a row that starts to copy waits a few steps before it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LookupPacing:
    share: float = 0.02  # what looking may cost while drafting is off, on average, as a share of a plain step
    most: int = 8  # ... and a look at least every this many steps
    seconds: dict[int, float] = field(default_factory=dict)  # by batch size: one lookup and plan, moving average
    quiet: int = 0  # steps in a row that drafted nothing (planned so, or not looked at)

    def looks(self, batch: int, plain: float | None) -> bool:
        """Whether a step of `batch` rows looks, plain decoding's step costing `plain` seconds (None: unmeasured):
        always right after a step that drafted and before anything is measured."""
        lookup = self.seconds.get(batch)
        if self.quiet == 0 or plain is None or lookup is None:
            return True
        every = min(self.most, max(1, int(lookup / (self.share * plain))))
        return self.quiet % every == 0

    def planned(self, drafted: bool) -> None:
        """A step was planned (or skipped: drafted=False)."""
        self.quiet = 0 if drafted else self.quiet + 1

    def observe(self, batch: int, seconds: float) -> None:
        """A step's lookups and plan at this batch size took this long."""
        old = self.seconds.get(batch)
        self.seconds[batch] = seconds if old is None else old + 0.1 * (seconds - old)
