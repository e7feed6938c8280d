"""One step's drafts from a drafter and the policy, and what the policy learns back: the one copy of this logic,
used by the decoder's loop (core/decoder.py) and by the replay of stored outputs (bench/bench_replay.py), so the
replay cannot drift from the loop.

`plan_step`: each row is offered what its drafter has (capped by its budget); the policy turns the offers into
acceptance chances and each row's draft length; the step drafts that. A free drafter is asked for everything it
has, so its proposal is checked against the output even where the policy drafts nothing. `observe_proposal`: after
the step, the policy learns from how far each row's proposal matched what the step emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..drafting import tree
from ..drafting.drafters import Draft, Drafter, GrowsTrees
from ..policy import DraftPolicy, RowAcceptance, expected_tokens
from ..step_costs import WALL_CLOCK, StepClock
from .rows import matched_run

# given a free drafter's full proposals (per row), each row's draft length: a replay's oracle instead of the policy
Chooser = Callable[[list[list[int]]], list[int]]


def plan_step(
    drafter: Drafter,
    policy: DraftPolicy,
    rows: Sequence[Any],
    budget: Sequence[int],
    choose: Chooser | None = None,
    clock: StepClock = WALL_CLOCK,
) -> tuple[Draft, Draft]:
    """This step's draft, and what the drafter proposed (for acceptance statistics and calibration).

    rows: the drafter's view of the batch (each with `acceptance`, `params`); budget: how many draft tokens each
    row can still take. choose: lengths from the full proposal instead of the policy (free drafters only). clock:
    what a tree's growth costs (the decoder's)."""
    if policy.k_max == 0 and choose is None:  # speculation off (the `none` drafter): nothing to offer or plan
        return _nothing(rows), _nothing(rows)
    if drafter.free and choose is None and not policy.consults(len(rows)):
        policy.skip()  # drafting is off and looking costs more than it is worth this step (DraftPolicy.consults)
        return _nothing(rows), _nothing(rows)
    looked = clock.start()
    available = [min(a, b) for a, b in zip(drafter.available(rows, policy.k_max), budget)]
    width = policy.tree_width_for(len(rows))
    if width > 1 and isinstance(drafter, GrowsTrees) and choose is None and all(_tree_row(r) for r in rows):
        return _plan_tree(drafter, policy, rows, available, width, clock)
    full = drafter.propose(rows, available) if drafter.free and any(available) else None
    if full is not None:
        available = [len(t) for t in full.tokens]
    if choose is not None:
        ks = choose(full.tokens) if full is not None else [0] * len(rows)
    else:
        confidence = full.confidence if full is not None and full.confidence is not None else [None] * len(rows)
        offers = [policy.accept_probs(r.acceptance, a, c) for r, a, c in zip(rows, available, confidence)]
        ks = policy.plan(len(rows), offers, probe=not drafter.free, trust=[r.acceptance.trust for r in rows])
        for r, q, k in zip(rows, offers, ks):
            r.acceptance.promise(expected_tokens(q, k) - 1.0)
        lookup = getattr(clock, "lookup", None)  # a clock written before `lookup` existed: every step looks
        if drafter.free and lookup is not None:
            policy.observe_lookup(len(rows), lookup(looked, len(rows)))
    if drafter.has_probs:
        # with a sampling draft model the sample at a position depends on whether a draft was verified there,
        # so a seeded sampled row drafts a length of its own (not the batch's adaptive k): same seed, same
        # output, whatever batch it is in
        ks = [a if (r.params.seed is not None and not r.params.greedy) else kb for r, a, kb in zip(rows, available, ks)]
    if full is not None:
        draft = Draft(
            tokens=[t[:kb] for t, kb in zip(full.tokens, ks)],
            probs=full.probs,
            forwards=full.forwards,
            confidence=None if full.confidence is None else [c[:kb] for c, kb in zip(full.confidence, ks)],
        )
        return draft, full
    if not any(ks):
        return _nothing(rows), _nothing(rows)
    draft = drafter.propose(rows, ks)
    return draft, draft


def _plan_tree(
    drafter: GrowsTrees, policy: DraftPolicy, rows: Sequence[Any], available: list[int], width: int, clock: StepClock
) -> tuple[Draft, Draft]:
    """EAGLE-2's order: grow each row's tree first (as deep as the policy allows, pruned where a node is unlikely
    to be reached), then verify the nodes likeliest to be reached, as many as pays (DraftPolicy.tree_nodes). The
    head's confidence, calibrated, says per step how far to go: a chain's length is planned before drafting from
    the row's recent acceptance, which on free text let a few misses switch drafting off. Returns the verified tree
    and the grown one (every node is judged against the emitted tokens: DraftPolicy.observe_tree)."""
    depths = policy.tree_depths(len(rows), available)
    if not any(depths):
        return _nothing(rows), _nothing(rows)

    def rate(b: int, depth: int, confidence: float) -> float:
        return policy.node_rate(rows[b].acceptance, depth, confidence)

    def worth_growing(beam: list[float]) -> bool:
        return policy.worth_growing(len(rows), beam)

    started = clock.start()
    grown = drafter.propose_tree(
        rows,
        depths,
        width,
        rate=rate if policy.adaptive else None,
        floor=policy.node_floor(len(rows)),
        grow=worth_growing,
    )
    if grown.forwards:  # a hybrid whose rows all copy grows nothing
        policy.observe_growth(clock.growth(started, grown.forwards))
    conf, parents = grown.confidence, grown.parents
    reach = [
        tree.reaches(p, [rate(b, d, c) if policy.adaptive else c for d, c in zip(tree.depths(p), cs)])
        for b, (p, cs) in enumerate(zip(parents, conf))
    ]
    ns = policy.tree_nodes(len(rows), reach, depths)
    if not any(ns):  # plain decoding pays best this step: the grown tree is still judged
        return Draft(tokens=[[] for _ in rows], forwards=grown.forwards), grown
    kept = [tree.subtree(t, p, tree.best_nodes(r, p, n)) for t, p, r, n in zip(grown.tokens, parents, reach, ns)]
    return Draft(tokens=[t for t, _ in kept], parents=[p for _, p in kept], forwards=grown.forwards), grown


def _nothing(rows: Sequence[Any]) -> Draft:
    return Draft(tokens=[[] for _ in rows])


def _tree_row(row: Any) -> bool:
    """Trees are verified greedily by the target's own argmax (core/drafting/tree.walk): greedy rows whose logits nothing
    shapes (bias, penalties) and no grammar constrains. Other batches draft chains."""
    return row.params.greedy and not row.params.shapes_logits and getattr(row, "grammar", None) is None


def observe_proposal(
    policy: DraftPolicy,
    acceptance: RowAcceptance,
    proposal: Sequence[int],
    confidence: list[float] | None,
    emitted: Sequence[int],
    accepted: int,
    free: bool,
) -> None:
    """One row's step, for the policy: a free drafter's whole proposal is compared with what the step emitted
    (beyond that nothing was checked); for any other drafter the proposal is the draft and the verifier's
    accepted count is the run. emitted: the step's tokens after any forced ones."""
    run = matched_run(proposal, emitted) if free else accepted
    acceptance.deliver(accepted)
    policy.observe_row(acceptance, confidence, run, checked=min(len(proposal), len(emitted)))


def observe_tree(
    policy: DraftPolicy,
    acceptance: RowAcceptance,
    tokens: Sequence[int],
    parents: Sequence[int],
    confidence: Sequence[float],
    emitted: Sequence[int],
) -> None:
    """One row's grown tree, for the policy: each node judged against the tokens the (greedy) step emitted."""
    verdicts = tree.checked(tokens, parents, emitted)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    continued = [any(verdicts[c] for c in children[i]) for i, v in enumerate(verdicts) if v and i in children]
    policy.observe_tree(acceptance, verdicts, tree.depths(parents), list(confidence), continued)
