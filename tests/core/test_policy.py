"""The draft-length policy: the expected-tokens formula, cost estimates, and the choices they lead to."""
from __future__ import annotations

import math

import pytest

from spec_batch.core.policy import DepthSurvival, DraftPolicy, RowAcceptance, StepCosts, expected_tokens


@pytest.mark.parametrize(
    "alpha,k,want",
    [
        (0.5, 0, 1.0),
        (0.0, 4, 1.0),
        (1.0, 4, 5.0),
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.8, 3, 1 + 0.8 + 0.64 + 0.512),
        (0.9, 8, sum(0.9**i for i in range(9))),
    ],
)
def test_expected_tokens(alpha, k, want):
    """sum_{i=0..k} alpha^i: the accepted run (geometric, capped at k) plus the target's own token."""
    assert math.isclose(expected_tokens(alpha, k), want, rel_tol=1e-9)


def test_expected_tokens_is_monotone():
    for alpha in (0.1, 0.5, 0.9, 0.999999):
        values = [expected_tokens(alpha, k) for k in range(10)]
        assert values == sorted(values) and values[-1] <= 10


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


@pytest.mark.parametrize(
    "alpha,k,continuation,want",
    [
        (0.5, 3, [1.0, 0.5, 0.25, 0.1], 1 + 0.5 * 1.75),
        (0.5, 0, [1.0, 0.5], 1.0),
        (0.8, 2, [1.0, 1.0, 1.0], 1 + 0.8 * 2),  # runs never break once started
        (0.8, 4, [1.0, 0.5], 1 + 0.8 * 1.5),  # a curve shorter than k: only what it covers
        (0.0, 4, [1.0, 1.0, 1.0, 1.0], 1.0),
    ],
)
def test_expected_tokens_with_continuation(alpha, k, continuation, want):
    """1 + alpha * sum(continuation[:k]): the target's own token, plus each draft position's chance to be reached
    (the row's first-token acceptance times the shared chance that a started run gets that far)."""
    assert math.isclose(expected_tokens(alpha, k, continuation), want, rel_tol=1e-12)


def test_expected_tokens_with_a_geometric_continuation_is_the_geometric_formula():
    alpha = 0.7
    geometric = [alpha**j for j in range(8)]
    for k in range(8):
        assert math.isclose(expected_tokens(alpha, k, geometric), expected_tokens(alpha, k), rel_tol=1e-12)


def test_step_costs_estimates():
    c = StepCosts()
    assert c.estimate(1, 3) is None
    c.observe(1, 1, 0.10)
    assert c.estimate(1, 1) == 0.10
    assert math.isclose(c.estimate(1, 5), 0.10 * (1 + 0.05 * 4))  # optimistic prior from one measurement
    assert c.estimate(2, 1) is None  # other batch sizes are not guessed from this one
    c.observe(1, 5, 0.30)
    assert math.isclose(c.estimate(1, 3), 0.20)  # interpolated
    assert math.isclose(c.estimate(1, 9), 0.50)  # extrapolated past the widest
    c.observe(1, 1, 0.20)  # moving average
    assert math.isclose(c.estimate(1, 1), 0.10 + 0.3 * 0.10)


def _policy_with_costs(per_width: dict[int, float], batch: int = 1, k_max: int = 8) -> DraftPolicy:
    p = DraftPolicy(k_max=k_max)
    for width, seconds in per_width.items():
        p.observe_step(batch, width, seconds)
    return p


def test_chooses_no_drafting_when_acceptance_is_near_zero():
    p = _policy_with_costs({1: 1.0, 2: 1.5, 5: 3.0, 9: 5.0})
    assert p.choose(1, [0.01], [8]) == 0


def test_chooses_long_drafts_when_acceptance_is_near_one():
    p = _policy_with_costs({1: 1.0, 2: 1.02, 5: 1.05, 9: 1.1})
    assert p.choose(1, [0.999], [8]) == 8
    assert p.choose(1, [0.999], [3]) == 3  # never more than the drafter can offer


def test_large_batch_with_costly_width_switches_off():
    """At a batch size where verifying k + 1 tokens per row costs about k + 1 plain steps, drafting does not pay."""
    p = _policy_with_costs({w: float(w) for w in (1, 2, 3, 5, 9)}, batch=64)
    assert p.choose(64, [0.6] * 64, [8] * 64) == 0


def test_probes_now_and_then_while_switched_off():
    p = _policy_with_costs({1: 1.0, 2: 2.0, 5: 5.0, 9: 9.0})
    picks = [p.choose(1, [0.0], [8]) for _ in range(p.probe_every)]
    assert picks[:-1] == [0] * (p.probe_every - 1) and picks[-1] == 2


def test_never_probes_for_a_free_drafter():
    p = _policy_with_costs({1: 1.0, 2: 2.0, 5: 5.0, 9: 9.0})
    assert [p.choose(1, [0.0], [8], probe=False) for _ in range(3 * p.probe_every)] == [0] * (3 * p.probe_every)


def test_continuation_decides_between_short_and_long_drafts():
    """Same first-token acceptance, same costs: a curve where runs go on picks the longest draft, one where they
    stop after a token picks a short one."""
    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4, 7: 1.6, 9: 1.8}
    assert _policy_with_costs(costs).choose(1, [0.9], [8], [1.0] * 8) == 8
    assert _policy_with_costs(costs).choose(1, [0.9], [8], [1.0] + [0.01] * 7) == 1


def test_simple_cases():
    assert DraftPolicy(k_max=8).choose(1, [0.9], [0]) == 0  # nothing to offer
    assert DraftPolicy(k_max=0).choose(1, [0.9], [5]) == 0
    assert DraftPolicy(k_max=8, adaptive=False).choose(4, [0.0] * 4, [2, 7, 0, 1]) == 7
    assert DraftPolicy(k_max=4, adaptive=False).choose(1, [0.0], [9]) == 4
    assert DraftPolicy(k_max=8).choose(3, [0.5] * 3, [8, 8, 8]) == 4  # nothing measured yet: k_max // 2
    with pytest.raises(ValueError):
        DraftPolicy(k_max=-1)
    assert DraftPolicy(k_max=5).candidates[-1] == 5
