"""How often a draft policy looks at a free drafter's offers while drafting is off (core/policy.py `consults`).

Looking costs Python time per row (the suffix index's lookups, the policy's plan: ~1 ms of a 17 ms plain step at 8
rows on a 2-core CPU), paid on every step whether anything is drafted or not. While drafting is off, the offers are
looked at every n-th step, n such that looking costs at most `share` of a plain step on average (n <= `most`); a
step that does not look decodes plainly. At one row a look costs ~1% of a step: every step looks there; at 8-16
rows a row that starts to copy waits a few steps before it drafts.

At `dry_batch` rows and more, looks that keep finding nothing worth drafting thin out further: the interval doubles
every `dry_after` looks in a row that drafted nothing (or only a cost probe), up to one look in `dry_most` steps,
and the first look that drafts on its merits resets it. There a step is bound by compute, a draft token costs
nearly what a row's token does (a 16-row step drafting 4 tokens a row: 3.1x a plain one on a 2-core Zen 4), so
drafting seldom pays and a row that starts to copy loses little by waiting; the looks themselves (every step at 16
rows: ~2% of it) were a loss of their own (docs/benchmarks.md, bench_server). Below it, a look is cheap and a
late start costs the row its best stretch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LookupPacing:
    share: float = 0.02  # what looking may cost while drafting is off, on average, as a share of a plain step
    most: int = 8  # ... and a look at least every this many steps
    dry_batch: int = 8  # from this many rows: looks in a row that drafted nothing thin the looks out, ...
    dry_after: int = 4  # ... the interval doubling every this many of them, ...
    dry_most: int = 32  # ... up to a look every this many steps
    seconds: dict[int, float] = field(default_factory=dict)  # by batch size: one lookup and plan, moving average
    quiet: int = 0  # steps in a row that drafted nothing (planned so, or not looked at)
    dry: int = 0  # looks in a row that drafted nothing

    def looks(self, batch: int, plain: float | None) -> bool:
        """Whether a step of `batch` rows looks, plain decoding's step costing `plain` seconds (None: unmeasured):
        always right after a step that drafted and before anything is measured."""
        lookup = self.seconds.get(batch)
        if self.quiet == 0 or plain is None or lookup is None:
            return True
        every = min(self.most, max(1, int(lookup / (self.share * plain))))
        if batch >= self.dry_batch:  # a wide batch: fewer looks while they find nothing
            doublings = min(self.dry // self.dry_after, self.dry_most.bit_length())  # enough to reach dry_most
            every = max(every, min(self.dry_most, every << doublings))
        return self.quiet % every == 0

    def planned(self, drafted: bool, looked: bool = True, probe: bool = False) -> None:
        """A step was planned after a look (or skipped without one: looked=False, drafted=False). probe: it drafts
        only to re-measure what drafting costs (DraftPolicy's cost probes), which finds nothing worth drafting."""
        self.quiet = 0 if drafted else self.quiet + 1
        if looked:
            self.dry = 0 if drafted and not probe else self.dry + 1

    def observe(self, batch: int, seconds: float) -> None:
        """A step's lookups and plan at this batch size took this long."""
        old = self.seconds.get(batch)
        self.seconds[batch] = seconds if old is None else old + 0.1 * (seconds - old)
