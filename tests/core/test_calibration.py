"""Confidence calibration: priors, learning observed acceptance per bin and kind, and what a run observes."""

from __future__ import annotations

import pytest

from spec_batch.core.calibration import FIRST_AFTER_HIT, FIRST_AFTER_MISS, LATER, ConfidenceCalibration


def test_priors_trust_copying_rows_and_halve_cold_first_tokens():
    cal = ConfidenceCalibration()
    assert cal.rate(LATER, 1.0) == pytest.approx(0.95)  # the top bin's middle
    assert cal.rate(FIRST_AFTER_HIT, 0.42) == pytest.approx(0.45)
    assert cal.rate(FIRST_AFTER_MISS, 1.0) == pytest.approx(0.475)


def test_observations_move_a_bin_towards_what_was_seen():
    cal = ConfidenceCalibration(decay=1.0, prior_strength=2.0)
    for accepted in (True, False, False, False):
        cal.observe(LATER, 1.0, accepted)
    scale = (1 + 2 * 1.0) / (4 * 0.95 + 2)  # what a stated LATER confidence turned out to be worth
    assert cal.scale(LATER) == pytest.approx(scale)
    assert cal.rate(LATER, 1.0) == pytest.approx((1 + 2 * 0.95 * scale) / (4 + 2))
    assert cal.rate(LATER, 0.5) == pytest.approx(0.55 * scale)  # other bins: their confidence at the kind's worth
    assert cal.rate(FIRST_AFTER_HIT, 1.0) == pytest.approx(0.95)  # other kinds keep their prior


def test_a_run_observes_its_accepted_tokens_and_the_rejection_only():
    cal = ConfidenceCalibration(decay=1.0)
    cal.observe_run(after_hit=False, confidence=[0.9, 0.9, 0.3, 0.3], run=2, checked=4)
    assert cal.tries[FIRST_AFTER_MISS][9] == 1 and cal.hits[FIRST_AFTER_MISS][9] == 1
    assert cal.tries[LATER][9] == 1 and cal.hits[LATER][9] == 1  # token 2 accepted
    assert cal.tries[LATER][3] == 1 and cal.hits[LATER][3] == 0  # token 3 rejected; token 4 never judged
    cal.observe_run(after_hit=True, confidence=[0.9, 0.9], run=1, checked=1)  # only one token was checked
    assert cal.tries[FIRST_AFTER_HIT][9] == 1 and cal.tries[LATER][9] == 1


def test_accept_probs_use_the_first_token_kind_once():
    cal = ConfidenceCalibration()
    assert cal.accept_probs(True, [1.0, 0.05]) == pytest.approx([0.95, 0.05])
    assert cal.accept_probs(False, [1.0]) == pytest.approx([0.475])
