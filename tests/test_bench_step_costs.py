"""bench/bench_step_costs.py's fit (no model): the padding costs it reports are the ones that made the timings."""

from __future__ import annotations

import math
import random

import torch

from bench import bench_step_costs


def test_fit_recovers_the_costs_that_made_the_timings():
    base, t, p, j = 0.2, 0.03, 0.008, 0.15
    samples = [
        (ks, base * bench_step_costs.padded_step_cost(ks, t, p, j))
        for ks in bench_step_costs.mixes(8, 20, random.Random(0))
    ]
    got = bench_step_costs.fit(samples)
    for want, value in zip((base, t, p, j), got):
        assert math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-9)


def test_mixes_include_plain_steps_uniform_drafts_and_one_long_row():
    ms = bench_step_costs.mixes(4, 5, random.Random(1))
    assert [0, 0, 0, 0] in ms and [2, 2, 2, 2] in ms and [16, 0, 0, 0] in ms
    assert len(ms) == 3 + 4 + 4 + 5 and all(len(m) == 4 for m in ms)


def test_time_mixes_times_every_mix_in_rounds(tiny_llama):
    model = tiny_llama(1, vocab=1000, layers=2)  # token ids are drawn from 100 up
    plan = [[0, 0], [1, 3], [4, 0]]
    samples = bench_step_costs.time_mixes(model, 0, 1000, torch.device("cpu"), 2, 6, plan, repeats=2)
    assert [ks for ks, _ in samples] == plan
    assert all(seconds > 0 for _, seconds in samples)
