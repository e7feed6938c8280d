"""bench/bench_replay.py's simulation (no model, no database): known outputs replayed through the drafters."""

from __future__ import annotations

import random

import pytest

from bench import bench_replay


def _copying_job(n: int = 6) -> list[tuple[list[int], list[int]]]:
    """Requests whose outputs copy a long stretch of their prompts (an edit job)."""
    rng = random.Random(0)
    job = []
    for _ in range(n):
        text = [rng.randrange(10, 5000) for _ in range(120)]
        job.append((text + [1, 2], text[:100] + [7]))
    return job


def _free_job(n: int = 6) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(1)
    return [
        ([rng.randrange(10, 5000) for _ in range(40)], [rng.randrange(10, 5000) for _ in range(60)]) for _ in range(n)
    ]


@pytest.mark.parametrize("name", ["ngram", "suffix", "suffix + job memory"])
def test_replay_of_a_copying_job_drafts_long_runs(name):
    costs = bench_replay.step_costs(None)
    for adaptive in (False, True):
        stats = bench_replay.replay(_copying_job(), bench_replay.drafters()[name](), costs, 16, adaptive, (0.2, 2.0))
        assert stats.tokens == 6 * 101  # every output token replayed, none twice
        assert stats.tokens_per_step > 3.0
        assert stats.speedup(costs.estimate(1, 1)) > 2.0


def test_replay_of_free_text_stays_near_plain_decoding_with_the_adaptive_policy():
    costs = bench_replay.step_costs("1:1.0,2:1.2,5:1.6,9:2.2,17:3.4")  # drafting is dear: a wrong draft costs
    stats = bench_replay.replay(_free_job(), bench_replay.drafters()["suffix"](), costs, 16, True, (0.2, 2.0))
    assert stats.tokens == 6 * 60
    assert stats.accepted <= stats.drafted
    assert stats.speedup(1.0) >= 0.95


def _step_cost(ks: list[int]) -> float:
    return bench_replay.padded_step_cost(ks, 0.022, 0.0055, 0.18)  # the default model at batch 8 on a CPU


def test_padded_step_cost():
    assert bench_replay.padded_step_cost([0, 0, 0], 0.1, 0.01, 0.5) == 1.0  # a plain step
    assert bench_replay.padded_step_cost([4, 0, 2], 0.1, 0.01, 0.5) == 1.0 + 0.6 + 0.01 * 6 + 0.5


def test_batch_replay_of_a_copying_job_pays_and_the_oracle_bounds_the_policy():
    job = _copying_job(12)
    make = bench_replay.drafters()["suffix + job memory"]
    plain = bench_replay.replay_batch(job, make(), 4, 16, None, _step_cost, (0.2, 2.0))
    assert plain.tokens == 12 * 101 and plain.tokens_per_step == 1.0 and plain.drafted == 0
    adaptive = bench_replay.replay_batch(job, make(), 4, 16, "adaptive", _step_cost, (0.2, 2.0))
    oracle = bench_replay.replay_batch(job, make(), 4, 16, "oracle", _step_cost, (0.2, 2.0))
    assert adaptive.tokens == oracle.tokens == plain.tokens
    assert oracle.accepted == oracle.drafted  # it drafts exactly what will be accepted
    assert plain.cost / adaptive.cost > 1.5
    assert oracle.cost <= adaptive.cost * 1.01


def test_batch_replay_of_free_text_stays_near_plain_decoding():
    job = _free_job(12)
    make = bench_replay.drafters()["suffix"]
    plain = bench_replay.replay_batch(job, make(), 4, 16, None, _step_cost, (0.2, 2.0))
    adaptive = bench_replay.replay_batch(job, make(), 4, 16, "adaptive", _step_cost, (0.2, 2.0))
    assert adaptive.tokens == plain.tokens == 12 * 60
    assert plain.cost / adaptive.cost >= 0.95


@pytest.mark.parametrize("name", ["ngram", "suffix + job memory"])
def test_the_replay_drafts_what_the_decoder_drafted(tiny_decoder, name):
    """The replay plans with the decoder's own plan_step: replaying a job the decoder ran (fixed policy, batch 3,
    rows joining as others finish) drafts and accepts exactly what the decoder did."""
    from spec_batch import JobMemory, SamplingParams

    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [10, 20, 30, 10, 20, 30, 10], [5, 5, 5, 5, 1], [7, 8, 9], [3, 1, 3, 1, 3]]
    dec = tiny_decoder("ngram" if name == "ngram" else "suffix", adaptive=False)
    memory = JobMemory() if "memory" in name else None
    results = dec.generate(prompts, SamplingParams(max_new_tokens=20), batch_size=3, memory=memory)
    job = [(p, r.token_ids) for p, r in zip(prompts, results)]
    stats = bench_replay.replay_batch(job, bench_replay.drafters()[name](), 3, 4, "fixed", lambda ks: 1.0, (0.2, 2.0))
    assert stats.tokens == sum(len(r.token_ids) for r in results)
    assert stats.drafted == sum(r.stats.draft_tokens for r in results) > 0
    assert stats.accepted == sum(r.stats.accepted_tokens for r in results) > 0
