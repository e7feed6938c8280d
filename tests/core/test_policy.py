"""The draft-length policy: the expected-tokens formula, cost estimates, and the choices they lead to."""

from __future__ import annotations

import math
import random

import pytest

from spec_batch.core.policy import DepthSurvival, DraftPolicy, RowAcceptance, expected_tokens
from spec_batch.core.step_costs import PaddedCosts, StepCosts


@pytest.mark.parametrize(
    "accept_probs,k,want",
    [
        ([0.5] * 4, 0, 1.0),
        ([0.0] * 4, 4, 1.0),
        ([1.0] * 4, 4, 5.0),
        ([0.5] * 4, 2, 1.75),
        ([0.8, 0.5, 1.0], 3, 1 + 0.8 + 0.4 + 0.4),
        ([0.9] * 8, 8, sum(0.9**i for i in range(9))),
        ([0.5, 0.5], 5, 1.75),  # never more than the proposal
    ],
)
def test_expected_tokens(accept_probs, k, want):
    """1 + sum_j prod_{i<=j} q[i]: each draft position's chance to be reached, plus the target's own token."""
    assert math.isclose(expected_tokens(accept_probs, k), want, rel_tol=1e-9)


def test_row_acceptance():
    r = RowAcceptance()
    assert r.first == 0.5  # prior
    for _ in range(20):
        r.observe(4, rejected=False)
    assert r.first > 0.95
    for _ in range(40):
        r.observe(0, rejected=True)
    assert r.first < 0.1  # decay forgets old evidence


def test_row_acceptance_counts_by_hand():
    r = RowAcceptance(first_hits=0.2, first_tries=2.0, decay=0.5)
    assert r.first == 0.1
    r.observe(0, rejected=False)  # nothing was offered: no evidence
    assert (r.first_hits, r.first_tries) == (0.2, 2.0)
    r.observe(3, rejected=True)  # the first token was accepted (a later one rejected)
    assert (r.first_hits, r.first_tries) == (0.2 * 0.5 + 1, 2.0 * 0.5 + 1)
    r.observe(0, rejected=True)  # the first token was rejected
    assert (r.first_hits, r.first_tries) == (1.1 * 0.5, 2.0 * 0.5 + 1)
    assert math.isclose(r.first, 0.55 / 2.0)


# ---------------------------------------------------------------- DepthSurvival and expected_tokens(..., continuation)


def test_depth_survival_prior_is_one_rejection_in_two():
    s = DepthSurvival(depth=4)
    assert s.continuation(4) == [1.0, 0.5, 0.25, 0.125]
    assert s.continuation(0) == []
    # past the tracked depth the curve stays flat (nothing is known there)
    assert s.continuation(6) == [1.0, 0.5, 0.25, 0.125, 0.125, 0.125]


def test_depth_survival_observe_by_hand():
    s = DepthSurvival(depth=4, decay=0.5)
    s.observe(3, 1)  # offered 3, the first accepted, the second rejected
    # decayed: reached [1, 1, 1, 1], rejected [.5, .5, .5, .5]; then depths 0 and 1 reached, depth 1 rejected
    assert s.reached == [2.0, 2.0, 1.0, 1.0]
    assert s.rejected == [0.5, 1.5, 0.5, 0.5]
    # c[1] = 1 - 1.5 / 2; c[2] = c[1] * (1 - .5 / 1); c[3] = c[2] * (1 - .5 / 1)
    assert s.continuation(4) == [1.0, 0.25, 0.125, 0.0625]
    s.observe(2, 2)  # all offered tokens accepted: depths 0 and 1 reached, no rejection
    assert s.reached == [2.0, 2.0, 0.5, 0.5]
    assert s.rejected == [0.25, 0.75, 0.25, 0.25]
    assert s.continuation(3) == [1.0, 1 - 0.75 / 2.0, (1 - 0.75 / 2.0) * (1 - 0.25 / 0.5)]
    before = (list(s.reached), list(s.rejected))
    s.observe(0, 0)  # nothing offered: no evidence, no decay
    assert (s.reached, s.rejected) == before
    s.observe(10, 9)  # beyond the tracked depth: every depth reached, the rejection is past the curve
    assert s.reached == [2.0, 2.0, 1.25, 1.25] and s.rejected == [0.125, 0.375, 0.125, 0.125]


def test_depth_survival_learns_bursty_runs():
    """Runs that always go all the way: the curve rises towards 1 at every depth; runs that always stop after
    one token: it falls towards 0 after the first."""
    long_runs, short_runs = DepthSurvival(depth=5), DepthSurvival(depth=5)
    for _ in range(2000):
        long_runs.observe(4, 4)
        short_runs.observe(4, 1)
    assert all(c > 0.99 for c in long_runs.continuation(4))
    assert short_runs.continuation(3)[1:] < [0.01, 0.01]


def test_step_costs_estimates():
    c = StepCosts()
    assert c.estimate(1, 3) is None
    c.observe(1, 1, 0.10)
    assert c.estimate(1, 1) == 0.10
    assert math.isclose(c.estimate(1, 5), 0.10 * (1 + 0.05 * 4))  # optimistic prior from one measurement
    assert c.estimate(2, 1) is None  # nothing to take another batch size's shape from yet
    c.observe(1, 5, 0.30)
    assert math.isclose(c.estimate(1, 3), 0.20)  # interpolated
    assert math.isclose(c.estimate(1, 9), 0.50)  # extrapolated past the widest
    c.observe(1, 1, 0.20)  # moving average
    assert math.isclose(c.estimate(1, 1), 0.10 + 0.3 * 0.10)


def test_step_costs_of_a_batch_size_take_their_shape_from_the_nearest_measured_one():
    c = StepCosts()
    for width, seconds in {1: 0.20, 3: 0.30, 5: 0.40}.items():
        c.observe(8, width, seconds)
    c.observe(2, 1, 0.15)  # widths 1 and 2 cost the same here: one measurement gives no shape
    assert math.isclose(c.estimate(6, 3), 0.30)  # nothing at batch 6: batch 8's costs
    assert math.isclose(c.estimate(2, 3), 0.15 * 0.30 / 0.20)  # batch 8's shape, scaled to batch 2's width 1
    assert math.isclose(c.estimate(3, 5), 0.40)  # nothing at batch 3: the nearest batch size with a shape, 8
    c.observe(2, 3, 0.18)
    assert math.isclose(c.estimate(2, 5), 0.21)  # two widths of its own: its own line


def test_an_unmeasured_width_costs_at_least_its_extra_tokens_at_plain_steps_cost_a_token():
    """At a wide batch a step is bound by arithmetic: a shape borrowed from a narrow batch (bound by reading the
    weights, where drafts are nearly free) would promise wide steps nearly free."""
    c = StepCosts()
    for width, seconds in {1: 0.008, 5: 0.009}.items():  # batch 1: 4 more tokens cost 12%
        c.observe(1, width, seconds)
    c.observe(16, 1, 0.038)  # plain steps: 2 ms a token more a row
    per_token = (0.038 - 0.008) / 15
    assert math.isclose(c.estimate(16, 3), 0.038 + per_token * 16 * 2)  # not 0.038 * 0.0085 / 0.008
    assert math.isclose(c.estimate(1, 3), 0.0085)  # a width between measured ones: interpolated, no floor
    c.observe(16, 3, 0.050)
    assert math.isclose(c.estimate(16, 3), 0.050)  # measured: what it cost


def _policy_with_costs(per_width: dict[int, float], batch: int = 1, k_max: int = 8) -> DraftPolicy:
    p = DraftPolicy(k_max=k_max)
    for width, seconds in per_width.items():
        p.costs.observe_width(batch, width, seconds)
    return p


def test_row_acceptance_remembers_the_last_first_token():
    r = RowAcceptance(first_hits=0.2, first_tries=2.0)
    assert r.last_hit is False  # a skeptical prior
    assert RowAcceptance().last_hit is True  # prior 1/2
    r.observe(2, rejected=True)
    assert r.last_hit is True
    r.observe(0, rejected=False)  # nothing checked: unchanged
    assert r.last_hit is True
    r.observe(0, rejected=True)
    assert r.last_hit is False


def test_accept_probs_without_confidence_are_the_first_token_rate_then_the_survival_ratios():
    p = DraftPolicy(k_max=4)  # survival prior: c = [1, .5, .25, .125]
    r = RowAcceptance(first_hits=0.2, first_tries=2.0)
    assert p.accept_probs(r, 4) == [0.1, 0.5, 0.5, 0.5]
    assert p.accept_probs(r, 0) == []
    assert math.isclose(expected_tokens(p.accept_probs(r, 3), 3), 1 + 0.1 * (1 + 0.5 + 0.25))


def test_accept_probs_with_confidence_are_calibrated():
    p = DraftPolicy(k_max=4)
    cold, copying = RowAcceptance(first_hits=0.2, first_tries=2.0), RowAcceptance(first_hits=1.8, first_tries=2.0)
    # calibration priors: a cold row's first token at half its stated confidence; later tokens at theirs
    assert p.accept_probs(cold, 3, [1.0, 1.0, 0.5]) == pytest.approx([0.475, 0.95, 0.55])
    assert p.accept_probs(copying, 2, [1.0, 1.0]) == pytest.approx([0.95, 0.95])
    assert p.accept_probs(copying, 1, [0.3, 1.0]) == pytest.approx([0.35])


def test_observe_row_teaches_the_calibration_the_row_and_the_survival_curve():
    p = DraftPolicy(k_max=4)
    p.calibration.decay = 1.0
    r = RowAcceptance(first_hits=0.2, first_tries=2.0)
    p.observe_row(r, [1.0, 1.0, 1.0], run=1, checked=3)  # first accepted, second rejected, third never judged
    assert p.calibration.tries[1][9] == 1 and p.calibration.hits[1][9] == 1  # first token of a cold row
    assert p.calibration.tries[2][9] == 1 and p.calibration.hits[2][9] == 0  # the later token, rejected
    assert r.last_hit and math.isclose(r.first, (0.2 * 0.9 + 1) / (2.0 * 0.9 + 1))
    assert p.survival.reached[:2] == [2.0 * 0.995 + 1, 2.0 * 0.995 + 1]
    p.observe_row(r, None, run=0, checked=0)  # nothing checked: no evidence anywhere
    assert r.last_hit and p.calibration.tries[0] == [0.0] * 10


# ---------------------------------------------------------------- plan: per-row lengths and the batch's width


def test_plan_no_drafting_when_acceptance_is_near_zero():
    p = _policy_with_costs({1: 1.0, 2: 1.5, 5: 3.0, 9: 5.0})
    assert p.plan(1, [[0.01] * 8]) == [0]


def test_plan_long_drafts_when_acceptance_is_near_one():
    p = _policy_with_costs({1: 1.0, 2: 1.02, 5: 1.05, 9: 1.1})
    assert p.plan(1, [[0.999] * 8]) == [8]
    assert p.plan(1, [[0.999] * 3]) == [3]  # never more than the drafter can offer


def test_plan_large_batch_with_costly_width_switches_off():
    """At a batch size where verifying k + 1 tokens per row costs about k + 1 plain steps, drafting does not pay."""
    p = _policy_with_costs({w: float(w) for w in (1, 2, 3, 5, 9)}, batch=64)
    assert p.plan(64, [[0.6] * 8] * 64) == [0] * 64


def test_plan_gives_rows_their_own_lengths_and_counts_the_padding():
    """Costs 1.0 at width 1, +0.05 per extra token. A confident row and a hopeless one: the confident row drafts 16,
    the hopeless one nothing (its chance to get even one token is under min_reach), and the width is paid once.
    Expected tokens at k: 1 + sum_{j<=k} 0.95^j for the confident row, 1 for the other."""
    costs = {w: 1.0 + 0.05 * (w - 1) for w in (1, 2, 3, 4, 5, 7, 9, 13, 17)}
    p = _policy_with_costs(costs, batch=2, k_max=16)
    assert p.plan(2, [[0.95] * 16, [0.04] * 16]) == [16, 0]
    rate = {k: (2 + sum(0.95**j for j in range(1, k + 1))) / costs[1 + k] for k in (0, 1, 2, 3, 4, 6, 8, 12, 16)}
    assert max(rate, key=rate.get) == 16
    # a row with a short offer drafts what it has; the width follows the longest
    assert p.plan(2, [[0.95] * 16, [0.95] * 3]) == [16, 3]


def test_plan_stops_a_row_where_its_chance_to_get_there_falls_below_min_reach():
    p = _policy_with_costs({w: 1.0 for w in (1, 2, 3, 4, 5, 7, 9)})  # width is free: only min_reach cuts
    assert p.plan(1, [[0.5, 0.5, 0.5, 0.5, 0.5]]) == [4]  # 0.5^5 = 0.031 < 0.05
    assert p.plan(1, [[1.0, 1.0, 0.01, 1.0]]) == [2]


def test_plan_width_where_padding_makes_a_long_row_not_pay():
    """One row could draft at 0.6 per token. Alone (batch 1) it drafts 2: rate(k) = (1 + sum_{j<=k} 0.6^j) /
    cost(1 + k) is 1.0, 1.33, 1.40, 1.36 for k = 0..3. In a batch of 4 where the others have nothing, every
    row pays the width: (4 + sum_{j<=k} 0.6^j) / cost(1 + k) is best at k = 0."""
    costs = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8, 7: 2.2, 9: 2.6}
    p = _policy_with_costs(costs, batch=4)
    offers = [[0.6] * 8, [], [], []]
    rate = {k: (4 + sum(0.6**j for j in range(1, k + 1))) / costs[1 + k] for k in (0, 1, 2, 3, 4, 6, 8)}
    assert max(rate, key=rate.get) == 0
    assert p.plan(4, offers) == [0, 0, 0, 0]
    p1 = _policy_with_costs(costs, batch=1)
    rate1 = {k: (1 + sum(0.6**j for j in range(1, k + 1))) / costs[1 + k] for k in (0, 1, 2, 3, 4, 6, 8)}
    assert p1.plan(1, [[0.6] * 8]) == [max(rate1, key=rate1.get)] == [2]


def test_plan_probes_now_and_then_while_switched_off():
    p = _policy_with_costs({1: 1.0, 2: 2.0, 5: 5.0, 9: 9.0})
    picks = [p.plan(1, [[0.0] * 8]) for _ in range(p.probe_every)]
    assert picks[:-1] == [[0]] * (p.probe_every - 1) and picks[-1] == [2]


def test_plan_never_probes_a_free_drafters_hopeless_offer():
    """A free drafter's proposals are checked every step anyway: an offer with no chance is never drafted."""
    p = _policy_with_costs({1: 1.0, 2: 2.0, 5: 5.0, 9: 9.0})
    assert [p.plan(1, [[0.0] * 8], probe=False) for _ in range(3 * p.probe_every)] == [[0]] * (3 * p.probe_every)


def _run_policy(policy: DraftPolicy, batch: int, steps: int, accept: float, cost) -> list[list[int]]:
    """The decoder's plan -> step -> observe cycle against a cost function cost(step, ks)."""
    plans = []
    for t in range(steps):
        ks = policy.plan(batch, [[accept] * 8] * batch, probe=False)
        policy.observe_step(batch, ks, cost(t, ks))
        plans.append(ks)
    return plans


def _quiet(ks: list[int]) -> float:
    return 1.0 + 0.05 * max(ks)  # a CPU-like step: each extra verified token costs 5% of a step


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_busy_spell_does_not_lock_a_free_drafter_off(ragged, batch):
    """Issue 23 item 9: noisy step costs (a busy spell that hit the drafted steps hardest) switch drafting off; once
    the machine is quiet again the policy must draft again. Without probes the stale costs lock it off for good."""

    def cost(t: int, ks: list[int]) -> float:
        if 5 <= t < 120:  # other processes share the CPU: every step slower, drafted ones much more
            return _quiet(ks) * (rng.uniform(2.0, 8.0) if any(ks) else rng.uniform(1.0, 1.5))
        return _quiet(ks)

    for probes in (False, True):
        rng = random.Random(0)
        policy = DraftPolicy(k_max=8, ragged=ragged)
        if not probes:
            policy.cost_probe_first = policy.probe_every = 10**9
        plans = _run_policy(policy, batch, 400, 0.6, cost)
        assert all(any(ks) for ks in plans[1:5])  # on (after the first, plain, step)
        assert sum(any(ks) for ks in plans[10:120]) < 10  # then off through the spell
        drafting_after = sum(any(ks) for ks in plans[300:]) / 100
        if probes:
            assert drafting_after > 0.9, drafting_after
        else:
            assert drafting_after == 0.0  # the failure the probes fix


@pytest.mark.parametrize("ragged", [False, True])
def test_probes_cost_a_small_share_where_drafting_never_pays(ragged):
    """Drafted steps that really cost 3x: the probes find it each time, and back off to one step in probe_every."""
    policy = DraftPolicy(k_max=8, ragged=ragged)
    plans = _run_policy(policy, 4, 600, 0.6, lambda t, ks: 3.0 if any(ks) else 1.0)
    drafted = sum(any(ks) for ks in plans)
    assert 0 < drafted <= 600 / policy.probe_every + 6
    assert sum(any(ks) for ks in plans[300:]) <= 300 / policy.probe_every + 1


@pytest.mark.parametrize("ragged", [False, True])
def test_drafting_must_beat_plain_decoding_by_the_margin(ragged):
    """Widths 1 and 2 cost the same: a draft worth 5% more tokens stays off (margin 10%), one worth 20% is taken."""
    p = DraftPolicy(k_max=1, ragged=ragged)
    p.costs.observe_width(1, 1, 1.0)
    p.costs.observe_width(1, 2, 1.0)
    assert p.plan(1, [[0.05]], probe=False) == [0]
    assert p.plan(1, [[0.2]], probe=False) == [1]


def test_plan_simple_cases():
    assert DraftPolicy(k_max=8).plan(1, [[]]) == [0]  # nothing to offer
    assert DraftPolicy(k_max=0).plan(1, [[0.9] * 5]) == [0]
    assert DraftPolicy(k_max=8, adaptive=False).plan(4, [[0.0] * 2, [0.0] * 7, [], [0.0]]) == [2, 7, 0, 1]
    assert DraftPolicy(k_max=4, adaptive=False).plan(1, [[0.0] * 9]) == [4]
    cold = DraftPolicy(k_max=8)
    assert cold.plan(3, [[0.9] * 8] * 3) == [0, 0, 0]  # nothing measured yet: a plain step, the anchor
    cold.costs.observe_width(3, 1, 1.0)
    assert all(k > 0 for k in cold.plan(3, [[0.9] * 8] * 3))  # then the prior (5% a token) lets it draft
    ragged = DraftPolicy(k_max=8, ragged=True)
    assert ragged.plan(2, [[0.9] * 8] * 2) == [0, 0]
    with pytest.raises(ValueError):
        DraftPolicy(k_max=-1)
    assert DraftPolicy(k_max=5).candidates[-1] == 5


# ---------------------------------------------------------------- a target that skips padding (ragged)


def _ragged_policy(per_width: dict[float, float], batch: int, k_max: int = 8) -> DraftPolicy:
    """A ragged policy that measured steps costing per_width[1 + mean draft] whatever their padding (a target
    whose padded positions are free): one row drafting w - 1 beside rows drafting nothing, and every row alike."""
    p = DraftPolicy(k_max=k_max, ragged=True)
    for width, seconds in per_width.items():
        p.costs.observe_width(batch, width, seconds)
    for width, seconds in per_width.items():
        extra = round((width - 1) * batch)
        if extra > 0:
            p.observe_step(batch, [extra] + [0] * (batch - 1), seconds)  # the same real tokens, all on one row
    return p


def test_effective_width_weighs_padding_by_rho():
    assert PaddedCosts.width(1.0, [4, 0, 2, 0]) == 5  # padding as dear as a real token: the longest draft
    assert PaddedCosts.width(0.0, [4, 0, 2, 0]) == 2.5  # padding free: the mean draft
    assert PaddedCosts.width(0.5, [4, 0, 2, 0]) == 1 + 1.5 + 0.5 * 2.5
    assert PaddedCosts.width(0.25, []) == 1
    assert DraftPolicy(k_max=8).costs.tables.keys() == {1.0}  # a dense target: only the longest draft counts


@pytest.mark.parametrize("true_rho", [0.0, 0.25, 1.0])
def test_padded_costs_learn_what_a_padded_position_costs(true_rho):
    """Steps cost 1 + 0.1 a real token per row + 0.1 * true_rho a padded one: the table keyed by that weight
    predicts them best and is the one used; plans are then costed by it."""
    costs = PaddedCosts(ragged=True)
    patterns = [[0] * 8, [4] + [0] * 7, [2] * 8, [8, 8] + [0] * 6, [1, 3, 0, 0, 5, 0, 2, 0], [8] * 8, [6] + [1] * 7]
    for _ in range(6):
        for lengths in patterns:
            mean = sum(lengths) / 8
            costs.observe(8, lengths, 1.0 + 0.1 * mean + 0.1 * true_rho * (max(lengths) - mean))
    assert costs.rho == true_rho
    lone = [8] + [0] * 7
    assert math.isclose(costs.estimate(8, lone), 1.0 + 0.1 * (1 + true_rho * 7), rel_tol=0.02)


def test_ragged_plan_lets_a_long_row_draft_beside_rows_with_nothing():
    """The dense case of test_plan_width_where_padding_makes_a_long_row_not_pay: at batch 4 drafting did not pay
    because every row paid the width. When a step costs its real tokens (cost by mean width: 1.0 + 0.2 per token
    of the mean), row 0 drafts alone: rate(k) = (4 + sum_{j<=k} 0.6^j) / (1 + 0.2 k / 4) is best at k = 2."""
    costs = {1 + j / 4: 1.0 + 0.2 * j / 4 for j in range(0, 33)}
    p = _ragged_policy(costs, batch=4)
    rate = {k: (4 + sum(0.6**j for j in range(1, k + 1))) / (1.0 + 0.2 * k / 4) for k in range(0, 9)}
    best = max(rate, key=rate.get)
    assert best == 2 and rate[2] > rate[0]
    assert p.plan(4, [[0.6] * 8, [], [], []]) == [best, 0, 0, 0]


def test_ragged_plan_cuts_every_row_at_one_threshold():
    """Each row drafts while its chance to reach the next token is at least a shared threshold: the confident row
    goes further than the doubtful one, and a hopeless row drafts nothing."""
    costs = {1 + j / 3: 1.0 + 0.1 * j / 3 for j in range(0, 25)}
    p = _ragged_policy(costs, batch=3)
    offers = [[0.95] * 8, [0.7] * 8, [0.02] * 8]
    ks = p.plan(3, offers)
    assert ks[0] == 8 and 0 < ks[1] < 8 and ks[2] == 0
    reach = [[q[0] ** (j + 1) for j in range(len(q))] for q in offers]  # chance to get to token j
    drafted = [r for row, k in zip(reach, ks) for r in row[:k]]
    left = [r for row, k in zip(reach, ks) for r in row[k:] if r >= p.min_reach]
    assert min(drafted) >= max(left)  # one threshold: nothing left out is likelier than anything drafted


def test_ragged_plan_switches_off_when_tokens_cost_as_much_as_steps():
    p = _ragged_policy({1.0: 1.0, 2.0: 2.0, 3.0: 3.0, 5.0: 5.0}, batch=8)
    assert p.plan(8, [[0.6] * 8] * 8) == [0] * 8


@pytest.mark.parametrize("ragged", [False, True])
def test_a_width_measured_in_a_slow_moment_is_measured_again(ragged):
    """Steps really cost 1.0 + 0.01 per drafted token and 90% of draft tokens are accepted: long drafts pay. But
    width 3 was measured once at 3.0 (a slow moment). A width's cost is only measured where it is drafted, so
    without exploration the policy never drafts 2 or more again; drafting one token more every explore_every-th
    step re-measures it, and the policy climbs to long drafts."""

    def cost(_t: int, ks: list[int]) -> float:
        return 1.0 + 0.01 * max(ks)

    for explore in (0, 8):
        policy = DraftPolicy(k_max=8, ragged=ragged)
        policy.explore_every = explore
        policy.costs.observe_width(1, 1, 1.0)
        policy.costs.observe_width(1, 2, 1.01)
        policy.costs.observe_width(1, 3, 3.0)
        plans = _run_policy(policy, 1, 200, 0.9, cost)
        late = [ks[0] for ks in plans[150:]]
        if explore:
            assert min(late) >= 6, late
            assert sum(1 for ks in plans if ks[0] > 0) == 200  # exploring changes lengths, never switches drafting
        else:
            assert max(late) == 1, late  # the failure exploration fixes


def test_exploring_drafts_one_token_more_every_explore_every_drafting_steps():
    p = _policy_with_costs({1: 1.0, 2: 1.05, 3: 1.3, 5: 2.0, 9: 4.0})
    plans = [p.plan(1, [[0.7] * 8]) for _ in range(2 * p.explore_every)]
    best = plans[0][0]
    assert best >= 1
    explored = [i for i, ks in enumerate(plans) if ks != [best]]
    assert explored == [p.explore_every - 1, 2 * p.explore_every - 1]
    assert all(plans[i] == [best + 1] for i in explored)


# ---------------------------------------------------------------- trees: nodes chosen after the tree is grown


def test_tree_depths_wait_for_a_measured_plain_step():
    p = DraftPolicy(k_max=4, tree_width=3)
    assert p.tree_depths(1, [8, 2]) == [0, 0]
    p.costs.observe_width(1, 1, 1.0)
    assert p.tree_depths(1, [8, 2]) == [4, 2]


def test_tree_nodes_verify_as_many_likely_nodes_as_pay():
    """Costs 1.0 at width 1, +5% per verified node: a node pays where its reach beats about 5% of the step's
    tokens. Hopeless nodes are not verified at all; a fixed policy verifies depth + width - 1 whatever they say."""
    p = _policy_with_costs({w: 1.0 + 0.05 * (w - 1) for w in (1, 2, 3, 4, 5, 7, 9)})
    p.tree_width, p.explore_every = 3, 0
    assert p.tree_nodes(1, [[0.02, 0.01, 0.01, 0.005]], [2]) == [0]
    likely = [0.9, 0.05, 0.02, 0.8, 0.7, 0.01, 0.6]
    n = p.tree_nodes(1, [likely], [3])[0]
    assert n == 4  # the four above ~5%: 0.9, 0.8, 0.7, 0.6
    rates = {k: (1 + sum(sorted(likely, reverse=True)[:k])) / (1.0 + 0.05 * k) for k in (0, 1, 2, 3, 4, 6)}
    assert max(rates, key=rates.get) == n
    fixed = DraftPolicy(k_max=4, adaptive=False, tree_width=3)
    assert fixed.tree_nodes(1, [[0.01] * 9, [0.5] * 3, []], [3, 2, 0]) == [5, 3, 0]


def test_node_floor_is_a_verified_tokens_share_of_a_plain_step():
    p = _policy_with_costs({1: 1.0, 5: 1.4})
    assert math.isclose(p.node_floor(1), 0.1)
    assert DraftPolicy().node_floor(1) == 0.0  # nothing measured: every node may grow
    assert _policy_with_costs({1: 1.0, 5: 1.01}).node_floor(1) == p.min_reach


def test_observe_tree_learns_from_every_judged_node():
    p = DraftPolicy(k_max=4, tree_width=2)
    row = RowAcceptance()
    # depths 1, 1, 2, 2: the first-level node 0 matched, its child 2 did not; 1 missed; 3 (under 1) unknown
    p.observe_tree(row, [True, False, False, None], [1, 1, 2, 2], [0.9, 0.3, 0.7, 0.95], [False])
    assert p.calibration.tries[0][9] == 1.0 and p.calibration.hits[0][9] == 1.0  # first after a hit, 0.9
    assert p.calibration.tries[0][3] == 1.0 and p.calibration.hits[0][3] == 0.0
    assert p.calibration.tries[2][7] == 1.0 and p.calibration.hits[2][7] == 0.0  # a later node
    assert sum(p.calibration.tries[2]) == 1.0  # node 3 was not judged
    assert row.last_hit and math.isclose(row.first, (0.9 + 1) / (1.8 + 1))  # one step: a run of 1, then a miss
    assert p.continued == [1.0 * p.survival.decay, 2.0 * p.survival.decay + 1]  # node 0's child missed
    p.observe_tree(row, [False, False, None, None], [1, 1, 2, 2], [0.9, 0.3, 0.7, 0.95], [])
    assert not row.last_hit


def test_a_level_grows_where_its_beam_pays_for_the_head_forward():
    """A head forward costing 5% of a plain step; an accepted node's child accepted one time in 5 (measured)."""
    p = _policy_with_costs({1: 1.0, 5: 1.2})
    assert p.worth_growing(1, [0.01])  # nothing measured of growth yet: grow
    p.observe_growth(0.05)
    p.continued = [1.0, 5.0]
    assert p.worth_growing(1, [0.5, 0.2])  # 0.7 * 0.2 = 0.14 >= 0.05 * 1.7
    assert not p.worth_growing(1, [0.2])  # 0.04 < 0.05 * 1.2
    assert DraftPolicy(adaptive=False).worth_growing(1, [0.0])


# ---------------------------------------------------------------- a latency bound (a server's)


def test_a_latency_bound_keeps_every_rows_rate_within_its_slack():
    """The case of test_ragged_plan_cuts_every_row_at_one_threshold: unbounded, the confident row drafts 8 and the
    step costs 1.0 + 0.1 * (8 + k1) / 3 plain steps, so the hopeless row's tokens a second fall by a third. With a
    slack of 0.1 the plan keeps that row (1 expected token) within 10% of a plain step's rate: the step may cost at
    most 1.1 plain steps, so the rows draft 3 tokens between them."""
    costs = {1 + j / 3: 1.0 + 0.1 * j / 3 for j in range(0, 25)}
    offers = [[0.95] * 8, [0.7] * 8, [0.02] * 8]
    free = _ragged_policy(costs, batch=3).plan(3, offers)
    bounded = _ragged_policy(costs, batch=3)
    bounded.latency_slack = 0.1
    ks = bounded.plan(3, offers)
    assert sum(free) > 3 and ks[2] == 0 and 0 < sum(ks) <= 3
    assert bounded.costs.estimate(3, ks) <= 1.1 * bounded.costs.estimate(3, [0, 0, 0]) + 1e-9


def test_a_latency_bound_leaves_a_lone_row_its_best_plan():
    """At batch 1 the only row is the slowest: its expected rate beats plain decoding's whenever drafting is
    chosen at all, so the bound changes nothing there."""
    costs = {1: 1.0, 2: 1.05, 3: 1.1, 5: 1.2, 9: 1.5}
    offers = [[0.9] * 8]
    free = _policy_with_costs(costs).plan(1, offers)
    bounded = DraftPolicy(k_max=8, latency_slack=0.0)
    for width, seconds in costs.items():
        bounded.costs.observe_width(1, width, seconds)
    assert bounded.plan(1, offers) == free and free[0] > 0


def test_a_dense_step_under_a_latency_bound_drafts_only_what_the_slowest_row_can_pay_for():
    """Every row pays the width (a dense target): with one row copying and one not, the width is cut to what keeps
    the row that drafts nothing within the slack."""
    costs = {1: 1.0, 2: 1.08, 3: 1.16, 5: 1.32, 9: 1.64}
    offers = [[0.95] * 8, [0.01] * 8]  # the second row's offer is below min_reach: it drafts nothing
    free = _policy_with_costs(costs, batch=2).plan(2, offers)
    bounded = _policy_with_costs(costs, batch=2)
    bounded.latency_slack = 0.1
    assert max(free) > 1 and bounded.plan(2, offers) == [1, 0]


def test_a_latency_slack_must_be_a_share():
    with pytest.raises(ValueError, match="latency_slack"):
        DraftPolicy(latency_slack=-0.1)


# ---------------------------------------------------------------- what the plans realize


def test_drafting_that_realizes_less_than_plain_steps_raises_the_margin_until_it_stops_and_pays_back():
    """The estimates say drafting pays at batch 8 (steps measured cheap, acceptance 0.5: 1.6x plain's rate at best),
    but the drafting steps realize fewer tokens a second than the plain ones: the margin at batch 8 grows until the
    plan is plain decoding, other batch sizes keep theirs, and drafting that realizes more brings it back."""
    p = _policy_with_costs({1: 1.0, 2: 1.05, 3: 1.1, 5: 1.2, 9: 1.4}, batch=8)
    offers = [[0.5] * 8] * 8
    assert any(p.plan(8, offers))
    p.observe_step(8, [0] * 8, 1.0, emitted=8)
    for _ in range(40):  # plain steps: 8 tokens a second; drafting steps: 9 tokens in 1.4 s
        p.observe_step(8, [0] * 8, 1.0, emitted=8)
        p.observe_step(8, [8] * 8, 1.4, emitted=9)
    assert p.margin_at(8) == 2.0 and p.margin_at(1) == p.margin
    assert p.plan(8, offers) == [0] * 8
    for _ in range(40):  # drafting realizes 40 tokens in 1.4 s
        p.observe_step(8, [8] * 8, 1.4, emitted=40)
        p.observe_step(8, [0] * 8, 1.0, emitted=8)
    assert p.margin_at(8) == p.margin and any(p.plan(8, offers))


def test_a_step_without_its_emitted_tokens_teaches_no_realized_rate():
    p = _policy_with_costs({1: 1.0, 2: 1.05}, batch=2)
    for _ in range(50):
        p.observe_step(2, [4, 4], 5.0)
        p.observe_step(2, [0, 0], 1.0)
    assert p.realized == {} and p.margin_at(2) == p.margin


def test_a_rows_trust_is_what_its_drafts_delivered_of_what_the_plans_expected():
    r = RowAcceptance()
    assert r.trust == 1.0  # prior: as promised
    r.deliver(3)  # nothing promised: no evidence
    assert r.trust == 1.0
    for _ in range(20):
        r.promise(3.0)
        r.deliver(0)
    assert r.trust < 0.05
    for _ in range(40):
        r.promise(2.0)
        r.deliver(3)  # more than promised counts as kept, no more
    assert r.trust == 1.0


def test_a_latency_bound_holds_a_row_to_its_own_record():
    """Both rows offer drafts the calibration rates alike; the second row's drafts have been delivering a fiftieth
    of what was expected (2%), so a plan in which it drafts keeps its rate within the slack only at a cheap width."""
    costs = {1: 1.0, 2: 1.08, 3: 1.16, 5: 1.32, 9: 1.64}
    offers = [[0.95] * 8, [0.95] * 8]
    bounded = _policy_with_costs(costs, batch=2)
    bounded.latency_slack = 0.1
    trusted = bounded.plan(2, offers, trust=[1.0, 1.0])
    held = bounded.plan(2, offers, trust=[1.0, 0.02])
    assert max(trusted) > 2 and 0 < max(held) < max(trusted)
    fewest = 1.0 + 0.02 * sum(0.95 ** (j + 1) for j in range(held[1]))
    assert bounded.costs.estimate(2, held) <= 1.1 * fewest * bounded.costs.estimate(2, [0, 0]) + 1e-9


def test_while_drafting_is_off_a_wide_batch_looks_at_offers_only_every_few_steps():
    """A lookup costing 10% of a plain step: with LookupPacing.share 0.02, one step in 5 looks while no row drafts.
    A plan that drafts looks again every step; a cheap lookup (1% of a step) looks every step throughout."""
    p = _policy_with_costs({1: 1.0, 2: 1.5}, batch=8)
    p.observe_lookup(8, 0.1)
    assert p.consults(8)  # nothing planned yet
    looks = []
    for _ in range(20):
        if p.consults(8):
            looks.append(p.plan(8, [[0.01] * 4] * 8, probe=False))
        else:
            p.skip()
    assert 3 <= len(looks) <= 5 and not any(any(ks) for ks in looks)
    p.plan(8, [[0.99] * 8] * 8, probe=False)  # drafting pays: on again
    assert p.consults(8)
    cheap = _policy_with_costs({1: 1.0, 2: 1.5}, batch=8)
    cheap.observe_lookup(8, 0.01)
    cheap.plan(8, [[0.01] * 4] * 8, probe=False)
    assert all(cheap.consults(8) for _ in range(5))


def test_a_wide_batchs_looks_that_keep_finding_nothing_thin_out_until_one_drafts():
    """At 8 rows a lookup costing 10% of a plain step looks every 5th step; after LookupPacing.dry_after fruitless
    looks the interval doubles, up to dry_most; a look that drafts resets it, a cost probe does not. At one row a
    cheap lookup looks every step throughout."""
    p = _policy_with_costs({1: 1.0, 2: 1.5}, batch=8)
    p.observe_lookup(8, 0.1)
    weak, strong = [[0.01] * 4] * 8, [[0.99] * 8] * 8

    def looks_in(steps: int) -> int:
        looked = 0
        for _ in range(steps):
            if p.consults(8):
                looked += 1
                assert not any(p.plan(8, weak, probe=False))
            else:
                p.skip()
        return looked

    assert looks_in(5 * p.lookups.dry_after) == p.lookups.dry_after  # one step in 5 while few looks found nothing
    assert looks_in(320) < 320 // 10  # then thinner: one in 10, 20, ...
    assert p.lookups.dry >= 3 * p.lookups.dry_after
    assert looks_in(4 * p.lookups.dry_most) <= 5  # ... down to one in dry_most
    assert any(p.plan(8, strong, probe=False))  # a look that drafts: every step looks again, the interval reset
    assert p.consults(8) and p.lookups.dry == 0
    p.lookups.dry = 3 * p.lookups.dry_after
    p.lookups.planned(True, probe=True)  # a cost probe drafts, and found nothing worth drafting on its merits
    assert p.lookups.dry == 3 * p.lookups.dry_after + 1 and p.lookups.quiet == 0
    narrow = _policy_with_costs({1: 1.0, 2: 1.5}, batch=1)
    narrow.observe_lookup(1, 0.01)
    for _ in range(10 * narrow.lookups.dry_after):
        assert narrow.consults(1)
        assert not any(narrow.plan(1, [[0.01] * 4], probe=False))


def test_exploring_a_wider_plan_stays_within_the_latency_bound():
    """Every explore_every-th drafting step drafts one token more per row, except where that step would break the
    bound: the row that drafts nothing must not pay for the exploration."""
    costs = {1: 1.0, 2: 1.08, 3: 1.16, 5: 1.32, 9: 1.64}
    offers = [[0.95] * 8, [0.01] * 8]
    bounded = _policy_with_costs(costs, batch=2)
    bounded.latency_slack = 0.1
    # without the check the explore_every-th step would draft [2, 0], a step of 1.16 plain ones
    assert [bounded.plan(2, offers) for _ in range(2 * bounded.explore_every)] == [[1, 0]] * (2 * bounded.explore_every)


def _recounted_lengths(policy: DraftPolicy, batch: int, gains, drafting: bool, trust) -> list[int]:
    """The rule of `_best_lengths` as its docstring states it, every threshold counted afresh: the oracle for the
    incremental version that runs on every planned step."""
    reach = [[g[j] - g[j - 1] for j in range(1, len(g))] for g in gains]
    best, best_rate = [0] * len(gains), -1.0
    for threshold in ([] if drafting else [math.inf]) + sorted({p for r in reach for p in r}, reverse=True):
        ks = [sum(1 for p in r if p >= threshold) for r in reach]
        cost = policy.costs.estimate(batch, ks)
        each = [1.0 + g[k] for g, k in zip(gains, ks)]
        if any(ks) and not policy._within_latency(batch, cost, each, trust):
            continue
        rate = sum(each) / cost * (policy.margin_at(batch) if not any(ks) else 1.0)
        if rate > best_rate * 1.0001:
            best, best_rate = ks, rate
    return best


@pytest.mark.parametrize("slack", [None, 0.1])
def test_per_row_lengths_are_the_thresholds_rule_counted_afresh(slack):
    rng = random.Random(5)
    policy = DraftPolicy(k_max=16, ragged=True, latency_slack=slack)
    for batch in (1, 2, 4, 8, 16):  # steps whose drafted tokens cost 2-20% of a plain step's, noisy
        for _ in range(60):
            lengths = [rng.choice([0, 0, 1, 2, 4, 8, 16]) for _ in range(batch)]
            cost = 0.004 * (1 + 0.1 * batch) * (1 + rng.uniform(0.02, 0.2) * sum(lengths) / batch)
            policy.observe_step(batch, lengths, cost)
    drafted = 0
    for _ in range(300):
        batch = rng.choice([1, 2, 4, 8, 16])
        gains = []
        for _ in range(batch):
            g, alive = [0.0], 1.0
            for _ in range(rng.randint(0, 16)):
                alive *= rng.uniform(0.3, 1.0)
                if alive < policy.min_reach:
                    break
                g.append(g[-1] + alive)
            gains.append(g)
        trust = rng.choice([None, [rng.uniform(0.3, 1.0) for _ in range(batch)]])
        for drafting in (False, True):
            want = _recounted_lengths(policy, batch, gains, drafting, trust)
            assert policy._best_lengths(batch, gains, drafting, trust) == want
            drafted += any(want) and not drafting
    assert drafted > 100  # plans of the free choice that draft, not only plain decoding
