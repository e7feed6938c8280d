"""SamplingParams validation, logits -> probabilities against Hugging Face's warpers, seeded randomness."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from spec_batch.core.params import SamplingParams, fresh_seed
from spec_batch.core.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_TARGET,
    accept_uniform,
    exponential_noise,
    logits_to_probs,
    sample_from,
    sampling_tensors,
)
from spec_batch.errors import InvalidParameterError

CPU = torch.device("cpu")


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_greedy():
    p = SamplingParams()
    assert p.greedy and p.max_new_tokens >= 1 and p.top_k == 0 and p.top_p == 1.0 and p.seed is None and p.stop == []
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
        dict(max_new_tokens=2.5),
        dict(max_new_tokens=True),
        dict(max_new_tokens="8"),
        dict(temperature=-0.1),
        dict(temperature=1000.0),
        dict(temperature="hot"),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=-0.2),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_k=True),
        dict(seed=1.5),
        dict(seed="7"),
        dict(seed=True),
        dict(stop=[""]),
        dict(stop=[3]),
        dict(stop=""),
    ],
)
def test_bad_params_raise(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def test_param_normalization():
    p = SamplingParams(temperature=1, top_p=1, stop="END", seed=0)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop == ["END"] and p.seed == 0
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_from_dict_rejects_unknown_keys():
    p = SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0.5, "seed": 3})
    assert (p.max_new_tokens, p.temperature, p.seed) == (5, 0.5, 3)
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": 5})
    with pytest.raises(InvalidParameterError):
        SamplingParams.from_dict({"temperature": -1})


# ---------------------------------------------------------------- logits_to_probs vs Hugging Face's warpers


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF generate's sampling processors in HF's order: temperature, top-k, top-p, then softmax. logits [n, V]."""
    scores = logits.float()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


ROW_PARAMS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (2.0, 0, 1.0),
    (1.0, 5, 1.0),
    (0.7, 1, 1.0),
    (1.0, 0, 0.9),
    (1.0, 0, 0.3),
    (0.8, 10, 0.8),
    (1.3, 3, 0.95),
    (1.0, 100, 1.0),  # top_k > vocab: off
    (1.0, 0, 0.05),  # only the top token survives
]


@pytest.mark.parametrize("temperature,top_k,top_p", ROW_PARAMS)
def test_logits_to_probs_matches_hf_one_row(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 40, generator=gen) * 3  # [rows, n, V]
    got = logits_to_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    want = _reference_probs(logits[0], temperature, top_k, top_p)
    assert got.shape == (1, 3, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 3))


def test_logits_to_probs_mixed_rows_do_not_leak():
    """One batch, a different temperature/top-k/top-p on every row: each row equals its own reference."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ROW_PARAMS), 4, 50, generator=gen) * 2
    temps = torch.tensor([p[0] for p in ROW_PARAMS])
    top_k = torch.tensor([p[1] for p in ROW_PARAMS])
    top_p = torch.tensor([p[2] for p in ROW_PARAMS])
    got = logits_to_probs(logits, temps, top_k, top_p)
    for b, (t, k, p) in enumerate(ROW_PARAMS):
        torch.testing.assert_close(got[b], _reference_probs(logits[b], t, k, p), atol=1e-6, rtol=1e-5)


def test_sampling_tensors_shape_like_the_params():
    """One row per SamplingParams; a greedy row gets temperature 1 (its distribution is never sampled, and a
    temperature of 0 would divide by zero)."""
    params = [SamplingParams(**dict(zip(("temperature", "top_k", "top_p"), p))) for p in ROW_PARAMS]
    temps, top_k, top_p = sampling_tensors(params + [SamplingParams()], CPU)
    assert temps.tolist() == pytest.approx([p[0] for p in ROW_PARAMS] + [1.0])
    assert top_k.tolist() == [p[1] for p in ROW_PARAMS] + [0]
    assert top_p.tolist() == pytest.approx([p[2] for p in ROW_PARAMS] + [1.0])
    logits = torch.randn(len(params), 2, 50)
    got = logits_to_probs(logits, *sampling_tensors(params, CPU))
    for b, (t, k, p) in enumerate(ROW_PARAMS):
        torch.testing.assert_close(got[b], _reference_probs(logits[b], t, k, p), atol=1e-6, rtol=1e-5)


def test_logits_to_probs_accepts_low_precision_and_neg_inf():
    logits = torch.tensor([[[2.0, 1.0, float("-inf"), 0.0]]], dtype=torch.bfloat16)
    got = logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert got.dtype == torch.float32
    assert got[0, 0, 2] == 0 and got[0, 0, 3] == 0
    assert torch.isfinite(got).all()


def test_top_p_keeps_smallest_set_reaching_p():
    """The nucleus is the smallest set of top tokens whose mass is >= top_p (Holtzman et al.; HF; vLLM).

    With dyadic probabilities the sums are exact: [.5, .25, .125, .0625, .0625] at top_p=0.75 is {0, 1};
    at top_p=0.5 it is {0}. A token whose preceding mass already equals top_p must be dropped.
    """
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = probs.log().view(1, 1, -1)
    for top_p, kept in [(0.5, 1), (0.75, 2), (0.875, 3), (0.8, 3), (0.7, 2)]:
        got = logits_to_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([top_p]))[0, 0]
        want = _reference_probs(logits[0], 1.0, 0, top_p)[0]
        assert int((got > 0).sum()) == kept, (top_p, got)
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- seeded randomness


def test_noise_is_keyed_by_seed_position_stream():
    a = exponential_noise(7, 3, STREAM_TARGET, 16, CPU)
    assert torch.equal(a, exponential_noise(7, 3, STREAM_TARGET, 16, CPU))
    assert (a > 0).all() and torch.isfinite(a).all()
    for other in [(8, 3, STREAM_TARGET), (7, 4, STREAM_TARGET), (7, 3, STREAM_DRAFT), (7, 3, STREAM_ACCEPT)]:
        assert not torch.equal(a, exponential_noise(*other, 16, CPU)), other
    u = accept_uniform(7, 3, CPU)
    assert 0.0 <= u < 1.0 and u == accept_uniform(7, 3, CPU) and u != accept_uniform(7, 4, CPU)


def test_fresh_seeds_differ():
    seeds = {fresh_seed() for _ in range(50)}
    assert len(seeds) == 50 and all(0 <= s < 2**63 for s in seeds)


def test_exponential_noise_is_exp1():
    samples = torch.cat([exponential_noise(s, 0, STREAM_TARGET, 64, CPU) for s in range(200)])
    res = stats.kstest(samples.numpy(), "expon")
    assert res.pvalue > 1e-3, res


def test_exponential_race_samples_from_probs():
    """argmax(probs / Exp(1) noise) is an exact sample from probs; zero-probability tokens never come out."""
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    n = 20000
    gen = torch.Generator().manual_seed(3)
    noise = torch.empty(n, probs.numel()).exponential_(generator=gen)
    picks = sample_from(probs.expand(n, -1), noise)
    counts = torch.bincount(picks, minlength=probs.numel())
    assert counts[-1] == 0
    res = stats.chisquare(counts[:-1].numpy(), (probs[:-1] * n).numpy())
    assert res.pvalue > 1e-3, (counts, res)
    # and with the core's keyed noise, over seeds
    n2 = 3000
    keyed = torch.stack([exponential_noise(s, 5, STREAM_TARGET, probs.numel(), CPU) for s in range(n2)])
    counts2 = torch.bincount(sample_from(probs.expand(n2, -1), keyed), minlength=probs.numel())
    assert counts2[-1] == 0, f"a zero-probability token was sampled: counts {counts2.tolist()}"
    res2 = stats.chisquare(counts2[:-1].numpy(), (probs[:-1] * n2).numpy())
    assert res2.pvalue > 1e-3, (counts2, res2)
