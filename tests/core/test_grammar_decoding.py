"""Decoding under a grammar, against oracles, on tiny random models with a byte vocabulary that spells JSON.

- greedy constrained output == Hugging Face greedy `generate` with the same mask as a logits processor, for
  every drafter, at batch 1 and 8;
- sampled output under a `choice` grammar whose tokenizations overlap follows the exactly computed masked
  distribution (chi-square), with a draft model that is sometimes rejected;
- every output of a schema-constrained job parses and validates against its schema;
- forced tokens: drafted with certainty (counted in stats.forced_tokens), never by the `none` drafter;
- a grammar the engine gives up on mid-decode ends its own row (finish_reason "error", no engine dump), in
  Decoder.generate(return_errors=True) and in the engine beside other callers, the other rows unchanged.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from scipy import stats
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from spec_batch import SamplingParams
from spec_batch.core.engine import Engine
from spec_batch.core.structured.grammar import apply_bitmask, grammar_engine
from spec_batch.loading import build_decoder
from spec_batch.loading.factory import DRAFTERS_WITHOUT_MODEL

CPU = torch.device("cpu")
EOS = 0

BOUNDED = {  # every part is bounded, so a random model finishes the object within the budget
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ab", "abc", "no"]},
        "ok": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["yes", "no"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "age", "tags"],
    "additionalProperties": False,
}
FORMATS = {
    "schema": {"type": "json_schema", "json_schema": {"name": "rec", "schema": BOUNDED, "strict": True}},
    "json_object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": "(ab|c)+-[0-9]{1,3}"},
    "choice": {"type": "choice", "choices": ["yes", "ye", "no", "abc", "ab"]},
}
PROMPTS = [
    [9, 10, 11, 12, 9, 10, 11],
    [45, 56, 46],
    [20, 21, 22, 23, 24, 20, 21, 22],
    [57],
    [1, 2, 3, 4, 5, 6, 7, 8, 1, 2],
]
N_NEW = 40


@pytest.fixture(scope="module")
def decoders(tiny_target, tiny_draft, byte_tokenizer):
    def make(draft, **kw):
        return build_decoder(
            tiny_target, byte_tokenizer, target_name="tiny", draft=draft, device=CPU, num_draft_tokens=4, **kw
        )

    out = {
        "none": make("none"),
        "ngram": make("ngram"),
        "model": make(tiny_draft),
        "model-fixed": make(tiny_draft, adaptive=False),
    }
    if "suffix" in DRAFTERS_WITHOUT_MODEL:
        out["suffix"] = make("suffix")
    return out


class GrammarMask(LogitsProcessor):
    """The oracle's mask: a fresh matcher fed the generated tokens at every position (no speculation)."""

    def __init__(self, engine, response_format, prompt_len: int):
        self.engine, self.response_format, self.prompt_len = engine, response_format, prompt_len

    def __call__(self, input_ids, scores):
        for b in range(input_ids.shape[0]):
            state = self.engine.state(self.response_format)
            assert state.matcher.consume_tokens(input_ids[b, self.prompt_len :].tolist())
            apply_bitmask(scores[b : b + 1], state.mask().unsqueeze(0))
        return scores


def hf_constrained_greedy(model, tokenizer, ids: list[int], max_new: int, response_format) -> list[int]:
    engine = grammar_engine(tokenizer, [EOS])
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
            logits_processor=LogitsProcessorList([GrammarMask(engine, response_format, len(ids))]),
        )
    out = out[0, len(ids) :].tolist()
    return out[: out.index(EOS)] if EOS in out else out


@pytest.fixture(scope="module")
def greedy_refs(tiny_target, byte_tokenizer):
    return {
        name: [hf_constrained_greedy(tiny_target, byte_tokenizer, p, N_NEW, fmt) for p in PROMPTS]
        for name, fmt in FORMATS.items()
    }


# ---------------------------------------------------------------- greedy: the oracle


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "model-fixed", "suffix"])
def test_greedy_constrained_equals_hf_with_the_mask(decoders, greedy_refs, drafter, batch_size):
    if drafter not in decoders:
        pytest.skip(f"no {drafter} drafter in this build")
    dec = decoders[drafter]
    prompts = [p for _ in FORMATS for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=N_NEW, response_format=fmt) for fmt in FORMATS.values() for _ in PROMPTS]
    results = dec.generate(prompts, params, batch_size=batch_size)
    refs = [r for name in FORMATS for r in greedy_refs[name]]
    for res, ref, p in zip(results, refs, params):
        assert res.token_ids == ref, (p.response_format.type, res.text, ref)
        assert res.finish_reason == ("length" if len(ref) == N_NEW else "stop")
    assert any(r.finish_reason == "stop" for r in results) and any(r.finish_reason == "length" for r in results)
    forced = sum(r.stats.forced_tokens for r in results)
    if drafter == "none":
        assert forced == 0
        assert all(r.stats.target_forwards == r.stats.output_tokens for r in results)  # one token per forward
    else:
        assert forced > 0


def test_unconstrained_rows_in_a_constrained_batch_are_unchanged(decoders, tiny_target, hf_greedy):
    dec = decoders["model"]
    params = [SamplingParams(max_new_tokens=16, response_format=FORMATS["schema"] if b % 2 else None) for b in range(4)]
    results = dec.generate(PROMPTS[:4], params, batch_size=4)
    for b in (0, 2):
        assert results[b].token_ids == hf_greedy(tiny_target, PROMPTS[b], 16)


# ---------------------------------------------------------------- forced tokens


def test_forced_chains_ride_in_one_step(decoders, byte_tokenizer):
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {"name": {"enum": ["abc"]}, "age": {"enum": [7]}},
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        },
    }
    expected = '{"name": "abc", "age": 7}'
    for name, dec in decoders.items():
        res = dec.generate([PROMPTS[0]], SamplingParams(max_new_tokens=N_NEW, response_format=fmt))[0]
        assert res.text == expected and res.finish_reason == "stop"
        n = len(res.token_ids) + 1  # and the EOS
        if name == "none":
            assert res.stats.forced_tokens == 0 and res.stats.target_forwards == n
        else:
            assert res.stats.forced_tokens == n and res.stats.target_forwards == 1
            assert res.stats.draft_tokens == 0  # the drafter had nothing left to propose


def test_max_tokens_mid_structure_cut_the_text(decoders):
    for dec in decoders.values():
        res = dec.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, response_format=FORMATS["schema"]))[0]
        assert res.finish_reason == "length" and len(res.token_ids) == 3
        assert res.text == '{"name": '  # cut mid-structure, as the budget ran out


# ---------------------------------------------------------------- schema jobs


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.95}])
def test_every_output_of_a_schema_job_validates(decoders, drafter, sampling):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    params = [
        SamplingParams(max_new_tokens=80, seed=i, response_format=FORMATS["schema"], **sampling) for i in range(16)
    ]
    results = decoders[drafter].generate(prompts, params, batch_size=8)
    for res in results:
        assert res.finish_reason == "stop", res.text
        jsonschema.validate(json.loads(res.text), BOUNDED)


def test_stream_under_a_grammar_concatenates_to_generate(decoders):
    dec = decoders["model"]
    params = SamplingParams(max_new_tokens=N_NEW, response_format=FORMATS["schema"])
    chunks = list(dec.stream(PROMPTS[0], params))
    assert "".join(c.text for c in chunks) == dec.generate([PROMPTS[0]], params)[0].text
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    "eos, why", [(None, "needs a model with an EOS token"), (63, "fast (tokenizers-backed) tokenizer")]
)
def test_a_grammar_the_tokenizer_cannot_take_fails_that_request_only(tiny_target, fake_tokenizer_cls, eos, why):
    dec = build_decoder(
        tiny_target, fake_tokenizer_cls(eos_token_id=eos), target_name="tiny", draft="ngram", device=CPU
    )
    params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, response_format=FORMATS["choice"])]
    ok, bad = dec.generate([PROMPTS[0], PROMPTS[1]], params, return_errors=True)
    assert ok.finish_reason == "length"
    assert bad.finish_reason == "error" and why in bad.error


# The checks without a tokenizer pass it (nothing is forced at its start); after "b" or "c" the engine looks ahead
# through a million forced "a"s and gives up: a grammar that fails mid-decode.
FAILS_MID_DECODE = {"type": "regex", "pattern": "(b|c)a{1000000}"}


def _assert_grammar_failure(result) -> None:
    assert result.finish_reason == "error"
    assert result.error_param == "response_format" and result.error_code == "grammar_failed"
    assert result.error.startswith("response_format: the grammar engine gave up after")
    assert "<state>" not in result.error and "<grammar>" not in result.error and "\n" not in result.error


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_grammar_failing_mid_decode_ends_its_row_alone(decoders, drafter, batch_size):
    dec = decoders[drafter]
    others = [
        SamplingParams(max_new_tokens=N_NEW, response_format=FORMATS["schema"]),
        SamplingParams(max_new_tokens=N_NEW),
        SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=3, response_format=FORMATS["regex"]),
        SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=4),
    ]
    alone = dec.generate(PROMPTS[1:], others, batch_size=batch_size)
    bad = SamplingParams(max_new_tokens=N_NEW, response_format=FAILS_MID_DECODE)
    results = dec.generate(PROMPTS, [bad, *others], batch_size=batch_size, return_errors=True)
    _assert_grammar_failure(results[0])
    assert [r.token_ids for r in results[1:]] == [r.token_ids for r in alone]
    assert [r.finish_reason for r in results[1:]] == [r.finish_reason for r in alone]


def test_a_grammar_failing_mid_decode_in_the_engine_fails_only_its_caller(decoders):
    dec = decoders["ngram"]
    good = [
        SamplingParams(max_new_tokens=N_NEW),
        SamplingParams(max_new_tokens=N_NEW, response_format=FORMATS["choice"]),
    ]
    alone = dec.generate(PROMPTS[1:3], good)
    engine = Engine(dec, max_batch=4)
    try:
        stream = engine.stream(PROMPTS[0], SamplingParams(max_new_tokens=N_NEW, response_format=FAILS_MID_DECODE))
        first = next(stream)  # the row is in the batch when the others join it
        got = engine.generate(PROMPTS[1:3], good)
        last = [first, *stream][-1]
        assert last.finish_reason == "error"
        assert [r.token_ids for r in got] == [r.token_ids for r in alone]
        after = engine.generate(PROMPTS[1:3], good)  # the engine goes on
        assert [r.token_ids for r in after] == [r.token_ids for r in alone]
    finally:
        engine.stop()


# ---------------------------------------------------------------- sampling: the exact masked distribution

N_SAMPLES = 3000
CHOICE = {"type": "choice", "choices": ["yes", "ye", "y", "no", "abc", "ab"]}  # yes = yes | ye s | y e s ...


@pytest.fixture(scope="module")
def sharp_pair(tiny_llama):
    return tiny_llama(21, vocab=64, layers=2, lm_head_scale=4.0), tiny_llama(22, vocab=64, layers=1, lm_head_scale=4.0)


def exact_paths(model, tokenizer, prompt, response_format, temperature, top_k, top_p) -> dict[tuple[int, ...], float]:
    """P(token path) of every path the grammar allows (EOS-terminated, EOS dropped): the target's next-token
    distribution at each node, masked, then HF's temperature, top-k and top-p warpers, then softmax."""
    engine = grammar_engine(tokenizer, [EOS])
    out: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    while frontier:
        path, prob = frontier.pop()
        state = engine.state(response_format)
        assert state.matcher.consume_tokens(list(path))
        with torch.inference_mode():
            scores = model(input_ids=torch.tensor([prompt + list(path)])).logits[:, -1].float()
            apply_bitmask(scores, state.mask().unsqueeze(0))
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        probs = scores.softmax(-1)[0]
        for t in torch.nonzero(probs > 0).flatten().tolist():
            if t == EOS:
                out[path] = out.get(path, 0.0) + prob * float(probs[t])
            else:
                frontier.append((path + (t,), prob * float(probs[t])))
    return out


@pytest.mark.parametrize(
    "kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9)], ids=["t1", "t0.8-k6-p0.9"]
)
def test_sampled_choices_follow_the_masked_distribution(sharp_pair, byte_tokenizer, kw):
    target, draft_model = sharp_pair
    dec = build_decoder(
        target, byte_tokenizer, target_name="sharp", draft=draft_model, device=CPU, num_draft_tokens=4, adaptive=False
    )
    prompt = [45, 56, 46, 5]
    params = [SamplingParams(max_new_tokens=8, seed=50_000 + i, response_format=CHOICE, **kw) for i in range(N_SAMPLES)]
    results = dec.generate([prompt] * N_SAMPLES, params, batch_size=128)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        assert r.finish_reason == "stop"
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    exact = exact_paths(
        target, byte_tokenizer, prompt, CHOICE, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0)
    )
    assert abs(sum(exact.values()) - 1) < 1e-4
    assert not set(counts) - set(exact), "paths the constrained target gives probability 0"
    assert len([p for p in exact.values() if p * N_SAMPLES >= 5]) >= 4, "too few likely paths to test anything"
    big = [s for s, p in exact.items() if p * N_SAMPLES >= 5]
    obs = [counts.get(s, 0) for s in big] + [N_SAMPLES - sum(counts.get(s, 0) for s in big)]
    exp = [exact[s] * N_SAMPLES for s in big] + [(1 - sum(exact[s] for s in big)) * N_SAMPLES]
    if exp[-1] < 5:  # too little mass left for a cell of its own: fold it into the last likely path
        rest_obs, rest_exp = obs.pop(), exp.pop()
        obs[-1] += rest_obs
        exp[-1] += rest_exp
    res = stats.chisquare(obs, [e * N_SAMPLES / sum(exp) for e in exp])
    assert res.pvalue > 1e-3, (res, dict(zip(big, obs)), {s: exact[s] * N_SAMPLES for s in big})
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < drafted, "the test needs both accepted and rejected draft tokens"
    assert sum(r.stats.forced_tokens for r in results) > 0  # "yes", "no", "abc" force the EOS


# ---------------------------------------------------------------- the real default model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REAL_PROMPTS = [
    "Extract the person as JSON: Maria Lopez, 34, lives in Madrid.",
    "Extract the person as JSON: John Smith is 52 years old and comes from Boston.",
    "Give me a JSON record for a fictional person.",
]


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 8])
def test_default_model_greedy_constrained_equals_hf_and_validates(default_decoder, batch_size):
    dec = default_decoder
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    prompts = [dec.apply_chat_template([{"role": "user", "content": p}]) for p in REAL_PROMPTS]
    results = dec.generate(prompts, SamplingParams(max_new_tokens=60, response_format=fmt), batch_size=batch_size)
    engine = grammar_engine(dec.tokenizer, dec.eos_ids)
    for ids, res in zip(prompts, results):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = dec.target.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=60,
                do_sample=False,
                eos_token_id=sorted(dec.eos_ids),
                pad_token_id=sorted(dec.eos_ids)[0],
                logits_processor=LogitsProcessorList([GrammarMask(engine, fmt, len(ids))]),
            )
        ref = [t for t in out[0, len(ids) :].tolist() if t not in dec.eos_ids]
        assert res.token_ids == ref, (res.text, dec.tokenizer.decode(ref))
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(res.text), PERSON)
        assert res.stats.forced_tokens > 0
