"""The draft-length policy: the expected-tokens formula, cost estimates, and the choices they lead to."""
from __future__ import annotations

import math

import pytest

from spec_batch.core.policy import DraftPolicy, RowAcceptance, StepCosts, expected_tokens


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
    assert r.alpha == 0.5  # prior
    for _ in range(20):
        r.observe(4, rejected=False)
    assert r.alpha > 0.95
    for _ in range(40):
        r.observe(0, rejected=True)
    assert r.alpha < 0.1  # decay forgets old evidence


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


def test_simple_cases():
    assert DraftPolicy(k_max=8).choose(1, [0.9], [0]) == 0  # nothing to offer
    assert DraftPolicy(k_max=0).choose(1, [0.9], [5]) == 0
    assert DraftPolicy(k_max=8, adaptive=False).choose(4, [0.0] * 4, [2, 7, 0, 1]) == 7
    assert DraftPolicy(k_max=4, adaptive=False).choose(1, [0.0], [9]) == 4
    assert DraftPolicy(k_max=8).choose(3, [0.5] * 3, [8, 8, 8]) == 4  # nothing measured yet: k_max // 2
    with pytest.raises(ValueError):
        DraftPolicy(k_max=-1)
    assert DraftPolicy(k_max=5).candidates[-1] == 5
