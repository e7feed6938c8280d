"""How many tokens each row drafts next, and so the batch's verify width.

Each row's offer is turned into acceptance chances q[j] = P(draft token j accepted | the ones before it were):
from the drafter's per-token confidence, calibrated per drafter kind (ConfidenceCalibration), or, for drafters
without one, from the row's first-token acceptance and the shared run-length curve (DepthSurvival). Drafting
j tokens then yields 1 + sum_{i<j} prod_{l<=i} q[l] tokens in expectation (`expected_tokens`). A row stops
where its chance to get that far falls below `min_reach`, so a low-confidence row drafts nothing while others
draft 16. For each candidate width the step yields the rows' expected tokens at that width and costs what a step
of that width is measured to cost at this batch size (every row pays the width: short rows waste padding); the
best tokens per second wins. Width 1 is plain decoding, so speculation switches itself off where it does not pay;
drafting must beat it by a margin (`margin`), since a wrong "on" costs a step and the estimates are noisy. Switched off,
it keeps probing (a small, shrinking share of steps), and a probe's measured cost replaces the stale one: step costs
measured in a busy spell must not lock speculation off once the machine is quiet again.

Where the target skips padded positions (`ragged`: core/kv/padding.py; the packed CPU linears), a step costs what
its real tokens cost, not its width: then each row drafts its own length. A row drafts token j while its chance
to get there is at least a threshold shared by the batch; the threshold with the best expected tokens per
second wins. Its cost is looked up at an effective width between 1 + the mean draft (padding free) and 1 + the
longest (padding as dear as a real token), weighted by what a padded position is measured to cost (PaddedCosts).

What the plans realize is checked too: per batch size, the tokens a second of the steps that drafted against
those of the steps that did not, as decayed sums (`RealizedRates`). Where drafting steps realize less than plain
ones, the estimates are wrong somewhere (the costs a drafted width was measured at, the acceptance a drafter's
confidence promised), and the margin drafting must beat plain decoding by grows at that batch size, so the policy
drafts only its surest plans there; where they realize more, the margin falls back. The probes keep measuring.

A latency bound (`latency_slack`, a server's: online clients wait on their own rows) admits only plans under
which every row's expected tokens a second stay within 1 + slack of plain decoding's: a row that drafts little
would otherwise pay, in a longer step, for the rows beside it that draft much, and the slowest requests would
finish later than without speculation while the batch's tokens a second rose. A bulk job (None) maximizes
tokens a second alone.

Draft trees (a head's, at small batches) are chosen after they are grown: each node's calibrated confidence times
its ancestors' is its reach, and the nodes of highest reach are verified, as many as the same rule finds best
(`tree_nodes`); every grown node is judged against the emitted tokens (`observe_tree`).
"""

from __future__ import annotations

from .acceptance import DepthSurvival, RowAcceptance
from .calibration import ConfidenceCalibration, calibration_kind
from .lookup_pacing import LookupPacing
from .realized_rates import RealizedRates
from .step_costs import PaddedCosts


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


def _discounted(expected: float, trust: float) -> float:
    """A row's expected tokens with its drafts counted at the share it has been getting (RowAcceptance.trust)."""
    return 1.0 + (expected - 1.0) * trust


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
        latency_slack: float | None = None,
    ):
        if k_max < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k_max}")
        if latency_slack is not None and latency_slack < 0:
            raise ValueError(f"latency_slack must be >= 0 or None, got {latency_slack}")
        # None: tokens a second alone; else no row's expected rate may fall under plain's by more than this share
        self.latency_slack = latency_slack
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.k_max = k_max
        self.adaptive = adaptive
        # a drafter that grows trees (a head: core/heads/head_drafter.py) drafts them in batches of at most tree_batch rows
        # (1: a verify forward at batch 1 is bound by reading the weights, so extra nodes cost little there; at larger
        # batches every node is paid in compute), each node having `tree_width` children at most. 1: chains. How
        # many nodes a step verifies is chosen after the tree is grown, from its nodes' calibrated confidence
        # (tree_depths, tree_nodes); a tree step's cost is recorded under its node count.
        self.tree_width = tree_width
        self.tree_batch = tree_batch
        self.candidates = sorted({c for c in candidates if c <= k_max} | {k_max})
        self.min_reach = min_reach
        self.ragged = ragged  # a step costs its real tokens (the target skips padding), not its width
        # drafting must beat plain decoding's expected rate by this much: the estimates are noisy, and a wrong
        # "on" costs part of a step on every row, a wrong "off" a few tokens (docs/core.md, "Adaptive draft length")
        self.margin = margin
        self.realized: dict[int, RealizedRates] = {}  # by batch size: what drafting realized against plain steps
        # learned across calls (the workload's): step costs, run lengths, what stated confidence is worth
        self.costs = PaddedCosts(ragged)
        self.survival = DepthSurvival(depth=max(1, k_max) + 1)
        self.calibration = ConfidenceCalibration()
        # probes while drafting is off. A costly drafter probes acceptance every probe_every idle steps. A free drafter's
        # acceptance is observed anyway, but the cost of a drafted step is only measured while drafting: a busy spell
        # that inflated it must not lock speculation off for good. So where an offer has a chance (a plan that
        # drafts exists), its best drafting plan is tried after cost_probe_first idle steps, then after twice as
        # many each time it did not pay, up to probe_every; the probe's measured cost replaces the stale one.
        self.probe_every = 32
        self.cost_probe_first = 8
        self._cost_probe_every = self.cost_probe_first
        self._idle_steps = 0
        self._probing = False  # the planned step is a probe: its measured cost replaces the stale one
        # while drafting, every explore_every-th step drafts one token more per row than the best plan: a width's
        # cost is only measured where it is drafted, and step times vary from run to run, so without it a width
        # measured once in a slow moment would never be tried again (tests/core/test_policy.py shows the lock-in)
        self.explore_every = 8
        self._drafting_steps = 0
        # trees: seconds of one head forward growing a level, and decayed counts of an accepted node's grown
        # children having one accepted too (prior 1 in 2): whether a next level pays (worth_growing)
        self.growth_seconds: float | None = None
        self.continued = [1.0, 2.0]
        self.lookups = LookupPacing()  # while drafting is off, how often a free drafter's offers are looked at

    def tree_width_for(self, batch: int) -> int:
        return self.tree_width if batch <= self.tree_batch else 1

    def tree_depths(self, batch: int, available: list[int]) -> list[int]:
        """How deep each row's tree may grow (its nodes are chosen once grown): all 0 before a plain step has been
        measured (the cost every verify width is weighed against; as in `plan`)."""
        if self.k_max == 0 or (self.adaptive and self.costs.estimate(batch, [0]) is None):
            return [0] * len(available)
        return [min(self.k_max, a) for a in available]

    def node_rate(self, acceptance: RowAcceptance, depth: int, confidence: float) -> float:
        """A tree node's calibrated chance to be accepted once its parent was, from the drafter's confidence."""
        return self.calibration.rate(calibration_kind(depth > 1, acceptance.last_hit), confidence)

    def node_floor(self, batch: int) -> float:
        """The reach below which a node is not worth growing: what verifying one more token costs, as a share of a
        plain step (a node reached with chance r adds r tokens to a step yielding at least one)."""
        plain, wide = self.costs.estimate(batch, [0]), self.costs.estimate(batch, [4])
        if not self.adaptive or plain is None or wide is None:
            return 0.0
        return min(0.5, max(self.min_reach, (wide - plain) / 4 / plain))

    def worth_growing(self, batch: int, beam: list[float]) -> bool:
        """Whether a tree's next level pays for the head forward that grows it: the beam's reaches (the nodes fed)
        times the measured chance that an accepted node's child is accepted too (`continued`), against that forward's
        measured share of a plain step, in the step's tokens (1 + what the beam already brings)."""
        plain = self.costs.estimate(batch, [0])
        if not self.adaptive or plain is None or self.growth_seconds is None:
            return True
        hits, tries = self.continued
        return sum(beam) * hits / tries >= self.growth_seconds / plain * (1.0 + sum(beam))

    def observe_growth(self, seconds_per_forward: float) -> None:
        """A drafter's tree forward (one level of the head) took this long."""
        old = self.growth_seconds
        self.growth_seconds = seconds_per_forward if old is None else old + 0.1 * (seconds_per_forward - old)

    def tree_nodes(self, batch: int, reach: list[list[float]], depths: list[int]) -> list[int]:
        """How many of each row's grown nodes the step verifies (the likeliest to be reached: planning.plan_step).
        Adaptive: by expected tokens per second, as for chains' lengths (`_best_plan` over the nodes' reaches,
        highest first), 0 where verifying none pays best. Fixed: depth + width - 1 nodes (a chain's depth plus one
        node for each other first-level choice)."""
        if not self.adaptive:
            return [min(len(r), d + self.tree_width - 1) if d else 0 for r, d in zip(reach, depths)]
        gains = []
        for r in reach:
            gains.append([0.0])
            for x in sorted(r, reverse=True)[: max(self.candidates)]:
                gains[-1].append(gains[-1][-1] + x)
        ns = self._best_plan(batch, gains, drafting=False)
        if any(ns):
            self._drafting_steps += 1
            if self.explore_every and self._drafting_steps % self.explore_every == 0:
                ns = [min(n + 1, len(g) - 1) for n, g in zip(ns, gains)]
        return ns

    def observe_tree(
        self,
        acceptance: RowAcceptance,
        verdicts: list[bool | None],
        depths: list[int],
        confidence: list[float],
        continued: list[bool],
    ) -> None:
        """A tree's nodes judged against the step's emitted tokens (core/drafting/tree.checked): calibration learns from
        every judged node (verified or not), the row's first-token rate and the run lengths from the path.
        continued: for each accepted node with children grown, whether one of them was accepted too."""
        for c in continued:
            self.continued = [self.continued[0] * self.survival.decay + c, self.continued[1] * self.survival.decay + 1]
        for verdict, d, c in zip(verdicts, depths, confidence):
            if verdict is not None:
                self.calibration.observe(calibration_kind(d > 1, acceptance.last_hit), c, verdict)
        run = max((d for v, d in zip(verdicts, depths) if v), default=0)
        judged = max((d for v, d in zip(verdicts, depths) if v is not None), default=0)
        if judged:
            acceptance.observe(run, rejected=judged > run)
            self.survival.observe(judged, run)

    def accept_probs(self, acceptance: RowAcceptance, n: int, confidence: list[float] | None = None) -> list[float]:
        """q[j] for the first n tokens of a row's proposal (confidence: the drafter's, per token, if it has one)."""
        if n <= 0:
            return []
        if confidence is not None:
            return self.calibration.accept_probs(acceptance.last_hit, list(confidence[:n]))
        c = self.survival.continuation(n)
        return [acceptance.first] + [c[j] / c[j - 1] if c[j - 1] > 0 else 0.0 for j in range(1, n)]

    def plan(
        self, batch: int, offers: list[list[float]], probe: bool = True, trust: list[float] | None = None
    ) -> list[int]:
        """Each row's draft length this step. offers[b]: accept_probs of what row b can be offered (after budget
        caps). probe=True (a costly drafter): while off, draft 2 tokens every probe_every steps to measure acceptance.
        probe=False (a free drafter: its proposals are checked anyway): while off, try the best drafting plan now and
        then (see __init__) to re-measure what drafting costs, only where an offer has a chance. trust[b]: the share
        of its expected accepted tokens row b has been getting (RowAcceptance.trust; None: all 1), which the
        latency bound holds each row to."""
        ks = self._plan(batch, offers, probe, trust)
        self.lookups.planned(any(ks), probe=self._probing)
        return ks

    def consults(self, batch: int) -> bool:
        """Whether this step looks at a free drafter's offers (core/batch/planning.plan_step): LookupPacing's rule,
        always where the policy is not adaptive."""
        return not self.adaptive or self.lookups.looks(batch, self.costs.estimate(batch, [0]))

    def skip(self) -> None:
        """A step that did not look at the offers (`consults`): plain decoding, an idle step."""
        self.lookups.planned(False, looked=False)
        self._idle_steps += 1

    def observe_lookup(self, batch: int, seconds: float) -> None:
        """A step's lookups and plan took this long at this batch size (LookupPacing)."""
        self.lookups.observe(batch, seconds)

    def _plan(self, batch: int, offers: list[list[float]], probe: bool, trust: list[float] | None) -> list[int]:
        self._probing = False
        if self.k_max == 0 or not any(offers):
            return [0] * len(offers)
        if not self.adaptive:
            return [min(self.k_max, len(q)) for q in offers]
        if self.costs.estimate(batch, [0]) is None:
            # nothing measured yet: a plain step first, the cost every draft length is weighed against (drafting
            # first would leave the policy one drafted width and a guess for plain decoding to compare)
            return [0] * len(offers)
        gains = [_gains(q[: self.k_max], self.min_reach) for q in offers]
        ks = self._best_plan(batch, gains, drafting=False, trust=trust)
        if any(ks):
            self._idle_steps = 0
            self._cost_probe_every = self.cost_probe_first
            self._drafting_steps += 1
            if self.explore_every and self._drafting_steps % self.explore_every == 0:
                wider = [min(k + 1, len(g) - 1) for k, g in zip(ks, gains)]
                ks = wider if self._admissible(batch, gains, wider, trust) else ks  # exploring stays within the bound
            return ks
        self._idle_steps += 1
        if probe and self.probe_every and self._idle_steps >= self.probe_every:
            # acceptance is only observed while drafting: probe now and then, so a drafter that starts to pay (the
            # output began copying the prompt) is noticed
            self._idle_steps = 0
            self._probing = True
            return [min(2, len(q)) for q in offers]
        if not probe and self._idle_steps >= self._cost_probe_every:
            ks = self._best_plan(batch, gains, drafting=True, trust=trust)  # all zeros where no row has a chance
            if any(ks):
                self._idle_steps = 0
                self._cost_probe_every = min(2 * self._cost_probe_every, max(self.cost_probe_first, self.probe_every))
                self._probing = True
                return ks
        return [0] * len(offers)

    def _best_plan(
        self, batch: int, gains: list[list[float]], drafting: bool, trust: list[float] | None = None
    ) -> list[int]:
        """Each row's length by expected tokens per second; drafting=True: the best plan that drafts at all."""
        if self.ragged:
            return self._best_lengths(batch, gains, drafting, trust)
        lengths = [len(g) - 1 for g in gains]
        k = self._best_width(batch, gains, max(lengths), drafting, trust) - 1
        return [min(k, n) for n in lengths]

    def _best_width(
        self, batch: int, gains: list[list[float]], longest: int, drafting: bool, trust: list[float] | None
    ) -> int:
        if longest == 0:
            return 1
        best_width, best_rate = 1, -1.0
        for k in sorted({min(c, longest) for c in self.candidates} - ({0} if drafting else set())):
            cost = self.costs.estimate(batch, [k])
            each = [1.0 + g[min(k, len(g) - 1)] for g in gains]
            if k and not self._within_latency(batch, cost, each, trust):  # type: ignore[arg-type]
                continue
            rate = sum(each) / cost * (self.margin_at(batch) if k == 0 else 1.0)  # type: ignore[operator]
            if rate > best_rate * 1.0001:
                best_width, best_rate = 1 + k, rate
        return best_width

    def _best_lengths(
        self, batch: int, gains: list[list[float]], drafting: bool, trust: list[float] | None
    ) -> list[int]:
        """Per-row lengths when a step costs its real tokens: row b drafts token j while the chance to reach it
        (gains[b][j] - gains[b][j - 1], falling with j) is >= a threshold; the best threshold wins."""
        reach = [[g[j] - g[j - 1] for j in range(1, len(g))] for g in gains]
        thresholds = ([] if drafting else [float("inf")]) + sorted({p for r in reach for p in r}, reverse=True)
        # every draft token (its reach, its row), highest first: lowering the threshold past a token lengthens its
        # row by one, so each threshold's plan follows from the last one's (this runs on every planned step)
        tokens = sorted(((p, b) for b, r in enumerate(reach) for p in r), reverse=True)
        estimate, bound = self.costs.estimates(batch), self._latency_bound(batch)
        ks = [0] * len(gains)
        each = [1.0 + g[0] for g in gains]  # each row's expected tokens
        # what the latency bound counts: the same list as `each` where every draft is trusted in full
        counted = each if trust is None else [_discounted(e, t) for e, t in zip(each, trust, strict=True)]
        best, best_rate, added = [0] * len(gains), -1.0, 0
        for threshold in thresholds:
            while added < len(tokens) and tokens[added][0] >= threshold:
                b = tokens[added][1]
                ks[b] += 1
                each[b] = 1.0 + gains[b][ks[b]]
                if trust is not None:
                    counted[b] = _discounted(each[b], trust[b])
                added += 1
            cost = estimate(ks)
            if added and bound is not None and not cost <= bound * min(counted):  # type: ignore[operator]
                continue  # the latency bound (_within_latency)
            rate = sum(each) / cost * (1.0 if added else self.margin_at(batch))  # type: ignore[operator]
            if rate > best_rate * 1.0001:
                best, best_rate = list(ks), rate
        return best

    def _admissible(self, batch: int, gains: list[list[float]], ks: list[int], trust: list[float] | None) -> bool:
        """Whether a plan keeps every row within the latency bound (always without one)."""
        cost = self.costs.estimate(batch, ks)
        return cost is not None and self._within_latency(batch, cost, [1.0 + g[k] for g, k in zip(gains, ks)], trust)

    def _within_latency(self, batch: int, cost: float, each: list[float], trust: list[float] | None) -> bool:
        """Whether a drafting step of this cost keeps its slowest row within the latency slack of a plain step's
        rate; always, without a slack or before a plain step is measured. each[b]: row b's expected tokens, its
        drafts counted at trust[b] (None: all 1)."""
        bound = self._latency_bound(batch)
        if bound is None:
            return True
        fewest = min(each) if trust is None else min(_discounted(e, t) for e, t in zip(each, trust, strict=True))
        return cost <= bound * fewest

    def _latency_bound(self, batch: int) -> float | None:
        """The most a step may cost per expected token of its slowest row: plain decoding's step plus the slack."""
        plain = self.costs.estimate(batch, [0])
        return None if self.latency_slack is None or plain is None else plain * (1.0 + self.latency_slack)

    def observe_row(self, acceptance: RowAcceptance, confidence: list[float] | None, run: int, checked: int) -> None:
        """A row's proposal matched the step's emitted tokens for `run` tokens of the `checked` compared."""
        if checked <= 0:
            return
        if confidence is not None:
            self.calibration.observe_run(acceptance.last_hit, confidence, run, checked)
        acceptance.observe(run, rejected=run < checked)
        self.survival.observe(checked, run)

    def margin_at(self, batch: int) -> float:
        """What drafting must beat plain decoding's expected rate by at this batch size (RealizedRates)."""
        realized = self.realized.get(batch)
        return self.margin if realized is None else realized.margin

    def observe_step(self, batch: int, lengths: list[int], seconds: float, emitted: int | None = None) -> None:
        """A step of `batch` rows drafting these lengths took `seconds` (the step plan() planned last) and added
        `emitted` tokens to its rows (None: not told; the realized rates learn nothing)."""
        if emitted is not None and self.adaptive and seconds > 0:
            realized = self.realized.setdefault(batch, RealizedRates(self.margin))
            realized.observe(any(lengths), emitted, seconds, self.margin)
        self.costs.observe(batch, lengths, seconds, replace=self._probing)
        self._probing = False
