"""logit_bias, frequency_penalty and presence_penalty (OpenAI's semantics) at every verify position, and logprobs.

The oracle is a naive decoder written here: one full forward per token, the bias and penalties computed with a
Counter over the output so far. Speculative decoding (n-gram, suffix, a draft model, the target drafting for itself)
with the same parameters must give its tokens exactly, at batch 1 and 8; seeded sampling its exact samples; and
sampled sequences must follow the penalized distribution (chi-square). Logprobs under speculation equal plain
decoding's and a teacher-forced forward's.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from scipy import stats

from spec_batch import InvalidParameterError, SamplingParams
from spec_batch.core.logits_processing import shape_logits, shape_next
from spec_batch.core.sampling import STREAM_TARGET, exponential_noise, logits_to_probs, sample_from
from spec_batch.loading import build_decoder

CPU = torch.device("cpu")

PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3],
    [10, 20, 30, 40, 10, 20, 30, 40, 10, 20],
    [5, 5, 5, 5, 5, 5, 1],
    [7, 8, 9],
]
N_NEW = 24
PENALTIES = [
    dict(frequency_penalty=0.4, presence_penalty=0.3),
    dict(frequency_penalty=-0.5),  # rewards repeats: long copied runs, drafts accepted
    dict(presence_penalty=1.5, logit_bias={3: 2.0, 40: -100.0, "7": 1.0}),
    # four boosted tokens the penalty rotates: a cycle the drafters copy, and every draft token's penalty decides
    # the next position (a verifier that ignored the draft tokens before a position would break it)
    dict(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={3: 8.0, 11: 8.0, 29: 8.0, 40: 8.0}),
]


def _naive_shaped(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """OpenAI's formula, token by token (the independent reference). logits [V] -> [V] float."""
    out = logits.float().clone()
    for token, bias in params.logit_bias.items():
        out[token] += bias
    for token, count in Counter(output).items():
        out[token] -= count * params.frequency_penalty + params.presence_penalty
    return out


def naive_decode(model, prompt: list[int], params: SamplingParams, seed: int | None = None) -> list[int]:
    """Plain decoding, one full forward per token: greedy, or the exponential race keyed like the decoder's."""
    output: list[int] = []
    for pos in range(params.max_new_tokens):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        shaped = _naive_shaped(logits, params, output)
        if params.greedy:
            output.append(int(shaped.argmax()))
            continue
        probs = logits_to_probs(
            shaped.view(1, 1, -1),
            torch.tensor([params.temperature]),
            torch.tensor([params.top_k]),
            torch.tensor([params.top_p]),
        )[0, 0]
        output.append(int(sample_from(probs, exponential_noise(seed, pos, STREAM_TARGET, probs.shape[-1], CPU))))
    return output


@pytest.fixture(scope="module")
def decoders(tiny_decoder, tiny_draft, tiny_target):
    return {
        "none": tiny_decoder("none"),
        "ngram": tiny_decoder("ngram"),
        "ngram-fixed": tiny_decoder("ngram", adaptive=False),
        "suffix-fixed": tiny_decoder("suffix", adaptive=False),
        "model-fixed": tiny_decoder(tiny_draft, adaptive=False),
        "self": tiny_decoder(tiny_target, adaptive=False),
    }


# ---------------------------------------------------------------- the parameters


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(frequency_penalty=float("nan")),
        dict(presence_penalty="1"),
        dict(presence_penalty=float("inf")),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={"x": 1.0}),
        dict(logit_bias={1: float("nan")}),
        dict(logit_bias=[1, 2]),
        dict(logit_bias={True: 1.0}),
        dict(logprobs=1),
        dict(top_logprobs=-1),
        dict(top_logprobs=3),
        dict(logprobs=True, top_logprobs=1.5),
        dict(logprobs=True, top_logprobs=10**6),
    ],
)
def test_nonsense_is_rejected(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def test_params_normalize_and_round_trip_through_json_keys():
    p = SamplingParams(frequency_penalty=1, logit_bias={"12": -3, 4: 2.5}, logprobs=True, top_logprobs=2)
    assert p.frequency_penalty == 1.0 and isinstance(p.frequency_penalty, float)
    assert p.logit_bias == {12: -3.0, 4: 2.5} and p.shapes_logits
    assert SamplingParams.from_dict({"logit_bias": {"12": -3}}).logit_bias == {12: -3.0}
    assert not SamplingParams().shapes_logits and SamplingParams().logit_bias == {}


def test_a_bias_outside_the_vocabulary_fails_that_prompt(decoders):
    with pytest.raises(InvalidParameterError, match="logit_bias names token id 64"):
        decoders["none"].generate([[1, 2]], SamplingParams(logit_bias={64: 1.0}))


# ---------------------------------------------------------------- the shaping function


class _Row:
    def __init__(self, tokens, n_generated, params):
        self.tokens, self.n_generated, self.params = tokens, n_generated, params


def test_every_verify_position_counts_the_output_and_the_draft_before_it():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={2: 1.0})
    row = _Row([9, 9, 1, 2, 2], 3, params)  # prompt [9, 9] (never counted), output [1, 2, 2]
    draft = [2, 3, 2]
    logits = torch.randn(2, 4, 16)
    plain = _Row([1], 0, SamplingParams())
    out = shape_logits(logits, [row, plain], [draft, []])
    for j in range(4):
        want = _naive_shaped(logits[0, j], params, [1, 2, 2] + draft[:j])
        assert torch.allclose(out[0, j], want)
    assert torch.equal(out[1], logits[1])  # no parameters: untouched
    nxt = shape_next(logits[:, 0], [row, plain], [draft[:2], []])
    assert torch.allclose(nxt[0], _naive_shaped(logits[0, 0], params, [1, 2, 2, 2, 3]))


def test_no_parameters_no_copy():
    logits = torch.randn(1, 3, 8)
    assert shape_logits(logits, [_Row([1], 0, SamplingParams())], [[1, 2]]) is logits


# ---------------------------------------------------------------- the oracle


@pytest.fixture(scope="module")
def naive_refs(tiny_target):
    return {
        i: [naive_decode(tiny_target, p, SamplingParams(max_new_tokens=N_NEW, **kw)) for p in PROMPTS]
        for i, kw in enumerate(PENALTIES)
    }


@pytest.mark.parametrize("name", ["none", "ngram", "ngram-fixed", "suffix-fixed", "model-fixed", "self"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_with_penalties_equals_plain_decoding(decoders, naive_refs, name, batch_size):
    accepted = 0
    for i, kw in enumerate(PENALTIES):
        results = decoders[name].generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, **kw), batch_size=batch_size)
        assert [r.token_ids for r in results] == naive_refs[i], kw
        accepted += sum(r.stats.accepted_tokens for r in results)
        if name == "self":  # the target drafting for itself, shaped alike: every draft token is accepted
            assert all(r.stats.accepted_tokens == r.stats.draft_tokens > 0 for r in results)
    if name.endswith("fixed") or name == "self":
        assert accepted > 20, "the test needs accepted drafts"


def test_mixed_batch_rows_keep_their_own_parameters(decoders, naive_refs):
    params = [SamplingParams(max_new_tokens=N_NEW, **PENALTIES[i % len(PENALTIES)]) for i in range(len(PROMPTS))]
    results = decoders["ngram-fixed"].generate(PROMPTS, params, batch_size=8)
    assert [r.token_ids for r in results] == [naive_refs[i % len(PENALTIES)][i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", ["none", "ngram-fixed", "suffix-fixed"])
def test_seeded_sampling_with_penalties_equals_the_naive_sampler(decoders, tiny_target, name):
    """One-hot drafts draw the same keyed noise as plain decoding: the exact naive samples (a draft model draws
    other random numbers; its exactness is the statistical test's)."""
    for seed, kw in zip((3, 4, 5), PENALTIES[::-1]):
        params = SamplingParams(max_new_tokens=16, temperature=0.7, seed=seed, **kw)
        got = decoders[name].generate(PROMPTS[:2], params, batch_size=8)
        assert [r.token_ids for r in got] == [naive_decode(tiny_target, p, params, seed) for p in PROMPTS[:2]]


# ---------------------------------------------------------------- the statistical test

V_SMALL = 8
N_SAMPLES = 3000


def _exact_probs(model, prompt: list[int], n_tokens: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    seqs = list(itertools.product(range(V_SMALL), repeat=n_tokens))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + list(s) for s in seqs])).logits.float()
    out = {}
    for i, s in enumerate(seqs):
        logp = 0.0
        for j in range(n_tokens):
            shaped = _naive_shaped(logits[i, len(prompt) - 1 + j], params, list(s[:j])) / params.temperature
            logp += float(shaped.log_softmax(-1)[s[j]])
        out[s] = math.exp(logp)
    return out


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_sampled_sequences_follow_the_penalized_distribution(tiny_llama, fake_tokenizer, drafter):
    target = tiny_llama(11, vocab=V_SMALL, layers=2, lm_head_scale=10.0)
    draft = tiny_llama(12, vocab=V_SMALL, layers=1, lm_head_scale=10.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    dec = build_decoder(
        target,
        fake_tokenizer,
        target_name="sharp",
        draft=draft if drafter == "model" else drafter,
        device=CPU,
        num_draft_tokens=4,
        adaptive=False,
    )
    kw = dict(max_new_tokens=3, temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={3: 1.0})
    results = dec.generate(
        [prompt] * N_SAMPLES, [SamplingParams(seed=50_000 + i, **kw) for i in range(N_SAMPLES)], batch_size=256
    )
    counts = Counter(tuple(r.token_ids) for r in results)
    exact = _exact_probs(target, prompt, 3, SamplingParams(**kw))
    big = [s for s, p in exact.items() if p * N_SAMPLES >= 5]
    small = [s for s in exact if s not in big]
    obs = [counts[s] for s in big] + [sum(counts[s] for s in small)]
    exp = [exact[s] * N_SAMPLES for s in big] + [sum(exact[s] for s in small) * N_SAMPLES]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    unpenalized = _exact_probs(target, prompt, 3, SamplingParams(max_new_tokens=3, temperature=1.0))
    assert 0.5 * sum(abs(unpenalized[s] - exact[s]) for s in exact) > 0.1  # the test can see the penalties
    assert 0 < sum(r.stats.accepted_tokens for r in results) < sum(r.stats.draft_tokens for r in results)


# ---------------------------------------------------------------- with a grammar: penalties first, then the mask

GRAMMAR_FORMATS = [
    {"type": "regex", "pattern": "(ab|c)+-[0-9]{1,3}"},
    {"type": "json_object"},
]


@pytest.mark.parametrize("fmt", GRAMMAR_FORMATS, ids=["regex", "json_object"])
def test_penalties_under_a_grammar_equal_plain_decoding(tiny_target, tiny_draft, byte_tokenizer, fmt):
    """Bias and penalties shape the logits, then the mask forbids: a boosted forbidden token stays forbidden, and
    forced tokens stay certain (logprob 0). Speculative output == plain decoding's, and it matches the grammar."""

    def make(draft, **kw):
        return build_decoder(
            tiny_target, byte_tokenizer, target_name="tiny", draft=draft, device=CPU, num_draft_tokens=4, **kw
        )

    boosted = byte_tokenizer.encode("z")[0]  # never allowed by either format's start
    params = SamplingParams(
        max_new_tokens=30,
        response_format=fmt,
        frequency_penalty=0.8,
        presence_penalty=0.3,
        logit_bias={boosted: 50.0},
        logprobs=True,
    )
    prompts = [[9, 10, 11, 12, 9, 10, 11], [45, 56, 46], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]]
    plain = make("none").generate(prompts, params, batch_size=8)
    for draft in ("ngram", tiny_draft):
        spec = make(draft, adaptive=False).generate(prompts, params, batch_size=8)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        for s, p in zip(spec, plain):
            assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(s.logprobs, p.logprobs))
            assert s.token_ids[:1] != [boosted]
            # a forced token (the only one the grammar allows) has probability 1 under the constraint
            # (a forced EOS is counted in forced_tokens, not returned)
            certain = sum(abs(x.logprob) < 1e-6 for x in s.logprobs) + (s.finish_reason == "stop")
            assert certain >= s.stats.forced_tokens
    if fmt["type"] == "regex":
        import re

        assert all(re.fullmatch(fmt["pattern"], r.text) for r in plain if r.finish_reason == "stop")
