"""logprobs / top_logprobs: the target's log-probabilities of each output token, read off the verify forward.

Under speculation they equal plain decoding's (to float rounding: the forward runs at another width), and a
teacher-forced forward over prompt + output with the same bias and penalties gives the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from test_logits_processing import PENALTIES, PROMPTS, _naive_shaped

from spec_batch import SamplingParams, TokenLogprob

N_NEW = 20
TOL = 1e-4


@pytest.fixture(scope="module")
def decoders(tiny_decoder, tiny_draft, tiny_target):
    return {
        "none": tiny_decoder("none"),
        "ngram-fixed": tiny_decoder("ngram", adaptive=False),
        "suffix": tiny_decoder("suffix"),
        "model-fixed": tiny_decoder(tiny_draft, adaptive=False),
        "self": tiny_decoder(tiny_target, adaptive=False),
    }


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=N_NEW, logprobs=True, top_logprobs=3, **kw)


def _close(a: list[TokenLogprob], b: list[TokenLogprob]) -> None:
    assert [x.token_id for x in a] == [y.token_id for y in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < TOL
        assert len(x.top) == len(y.top) == 3
        assert all(abs(u[1] - v[1]) < TOL for u, v in zip(x.top, y.top))


def teacher_forced(model, prompt: list[int], output: list[int], params: SamplingParams) -> list[float]:
    """One forward over prompt + output; each output token's log-probability after bias and penalties."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0]
    return [
        float(_naive_shaped(logits[len(prompt) - 1 + j], params, output[:j]).log_softmax(-1)[t])
        for j, t in enumerate(output)
    ]


@pytest.mark.parametrize("kw", [{}, PENALTIES[0], PENALTIES[3]], ids=["plain", "penalties", "cycle"])
@pytest.mark.parametrize("name", ["ngram-fixed", "suffix", "model-fixed", "self"])
def test_logprobs_under_speculation_equal_plain_decoding(decoders, tiny_target, name, kw):
    params = _params(**kw)
    plain = decoders["none"].generate(PROMPTS, params, batch_size=8)
    spec = decoders[name].generate(PROMPTS, params, batch_size=8)
    for prompt, p, s in zip(PROMPTS, plain, spec):
        assert s.token_ids == p.token_ids and len(s.logprobs) == len(s.token_ids)
        _close(s.logprobs, p.logprobs)
        forced = teacher_forced(tiny_target, prompt, s.token_ids, params)
        assert all(abs(x.logprob - f) < TOL for x, f in zip(s.logprobs, forced))
        assert abs(sum(x.logprob for x in s.logprobs) - sum(forced)) < 1e-3
        for x in s.logprobs:  # greedy: the chosen token is the likeliest; top is sorted
            assert x.top[0][0] == x.token_id and x.top[0][1] == pytest.approx(x.logprob, abs=1e-6)
            assert [v for _, v in x.top] == sorted((v for _, v in x.top), reverse=True)
    if name in ("self", "model-fixed"):
        assert sum(r.stats.accepted_tokens for r in spec) > 0


def test_sampled_logprobs_are_of_the_temperature_one_distribution(decoders, tiny_target):
    params = _params(temperature=1.7, seed=9, **PENALTIES[0])
    for res, prompt in zip(decoders["ngram-fixed"].generate(PROMPTS, params, batch_size=8), PROMPTS):
        forced = teacher_forced(tiny_target, prompt, res.token_ids, params)
        assert all(abs(x.logprob - f) < TOL for x, f in zip(res.logprobs, forced))


def test_no_logprobs_unless_asked_and_none_in_to_dict(decoders):
    res = decoders["ngram-fixed"].generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0]
    assert res.logprobs is None and "logprobs" not in res.to_dict()
    res = decoders["ngram-fixed"].generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, logprobs=True))[0]
    assert len(res.logprobs) == 4 and all(x.top == [] for x in res.logprobs)
    assert res.to_dict()["logprobs"][0]["token_id"] == res.token_ids[0]


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(decoders):
    full = decoders["ngram-fixed"].generate(PROMPTS[:1], _params())[0]
    stop = " ".join(map(str, full.token_ids[5:7]))
    res = decoders["ngram-fixed"].generate(PROMPTS[:1], _params(stop=[stop]))[0]
    assert res.finish_reason == "stop" and len(res.logprobs) == len(res.token_ids) < len(full.token_ids)
    _close(res.logprobs, full.logprobs[: len(res.token_ids)])


@pytest.mark.parametrize("name", ["none", "ngram-fixed"])
def test_stream_carries_the_logprobs(decoders, name):
    params = _params(**PENALTIES[3])
    whole = decoders[name].generate(PROMPTS[:1], params)[0]
    chunks = list(decoders[name].stream(PROMPTS[0], params))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    _close([x for c in chunks for x in c.logprobs], whole.logprobs)
