"""response_format parsing, compiled-grammar caching, per-row matcher states and logit masks (no models)."""

from __future__ import annotations

import json

import pytest
import torch

from spec_batch.core.params import SamplingParams
from spec_batch.core.structured.grammar import (
    GrammarEngine,
    apply_bitmask,
    grammar_engine,
    mask_logits,
    parse_response_format,
    unpack_bitmask,
)
from spec_batch.core.structured.response_format import ResponseFormat
from spec_batch.errors import InvalidParameterError

EOS = 0
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    {"type": "regex", "pattern": "[a-c]{2,3}"},
    {"type": "choice", "choices": ["yes", "ye", "no"]},
    {"type": "lark", "grammar": 'start: "ab" NUM\nNUM: /[0-9]+/'},
]


@pytest.fixture()
def engine(byte_tokenizer) -> GrammarEngine:
    return GrammarEngine(byte_tokenizer, [EOS])


def allowed(bits: torch.Tensor, vocab: int = 64) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(bits, vocab)).flatten().tolist())


def fresh_mask(engine: GrammarEngine, fmt: dict, prefix: list[int]) -> set[int]:
    """The oracle: a new matcher that consumed prefix, its mask computed from scratch."""
    state = engine.state(fmt)
    for t in prefix:
        assert state.matcher.consume_token(t)
    return allowed(state.mask())


def ids(byte_tokenizer, text: str) -> list[int]:
    return byte_tokenizer.encode(text)


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("form", FORMS)
def test_every_form_round_trips_through_to_dict(form):
    fmt = parse_response_format(form)
    assert fmt.to_dict() == form
    assert parse_response_format(fmt.to_dict()) == fmt


def test_text_is_unconstrained():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format(None) is None


def test_json_object_validates_as_any_object():
    assert parse_response_format({"type": "json_object"}).schema == {"type": "object"}


@pytest.mark.parametrize(
    "form, field",
    [
        ("json", "response_format must be an object"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, "unknown field(s) ['schema']"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "json_schema.strict"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}, "unknown field(s) ['extra']"),
        ({"type": "regex"}, "response_format.pattern"),
        ({"type": "regex", "pattern": ""}, "response_format.pattern"),
        ({"type": "choice", "choices": []}, "response_format.choices"),
        ({"type": "choice", "choices": ["a", 1]}, "response_format.choices"),
        ({"type": "lark", "grammar": " "}, "response_format.grammar"),
    ],
)
def test_bad_shapes_name_the_field(form, field):
    with pytest.raises(InvalidParameterError, match=field.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_response_format(form)


@pytest.mark.parametrize(
    "form, reason",
    [
        ({"type": "regex", "pattern": "a["}, "unclosed character class"),
        ({"type": "lark", "grammar": "start: missing_rule"}, "missing_rule"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
            "look-around",
        ),
    ],
)
def test_what_the_engine_cannot_compile_is_an_error_with_its_reason(form, reason):
    with pytest.raises(InvalidParameterError, match="cannot compile") as info:
        parse_response_format(form)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    "form, field, reason",
    [
        ({"type": "regex", "pattern": "a{1000000}"}, "response_format.pattern", "too many expressions"),
        ({"type": "lark", "grammar": 'start: a\na: "x" a'}, "response_format.grammar", "Too many items"),
    ],
)
def test_what_exceeds_the_engines_limits_is_refused_before_decoding(form, field, reason):
    with pytest.raises(InvalidParameterError, match=f"^{field} exceeds the grammar engine's limits") as info:
        SamplingParams(response_format=form)
    message = str(info.value)
    assert reason in message and "\n" not in message and "<state>" not in message and "<grammar>" not in message


def test_a_grammar_text_past_the_bound_is_refused():
    big = {"type": "choice", "choices": ["x" * 60_000, "y" * 60_000]}
    with pytest.raises(InvalidParameterError, match="response_format .* characters long; at most 100000"):
        parse_response_format(big)


def test_sampling_params_parse_the_format_once_and_store_it_as_plain_json():
    form = FORMS[1]
    params = SamplingParams(max_new_tokens=8, response_format=form)
    assert isinstance(params.response_format, ResponseFormat)  # parsed once, into what the grammar takes
    assert SamplingParams(response_format=params.response_format).response_format is params.response_format
    stored = json.loads(json.dumps(params.to_dict()))  # what the job store writes and reads back
    assert SamplingParams.from_dict(stored) == params
    assert SamplingParams(response_format={"type": "text"}).response_format is None
    with pytest.raises(InvalidParameterError, match="response_format.choices"):
        SamplingParams.from_dict({"response_format": {"type": "choice", "choices": "yes"}})


# ---------------------------------------------------------------- compiling, cached


def test_a_second_use_of_a_grammar_costs_no_compile(engine):
    engine.state(FORMS[1])
    assert engine.compiles == 1
    engine.state(dict(FORMS[1]))  # an equal object, not the same one
    engine.state(SamplingParams(response_format=FORMS[1]).response_format)
    assert engine.compiles == 1
    engine.state(FORMS[2])
    assert engine.compiles == 2


def test_the_cache_is_a_bounded_lru(byte_tokenizer):
    engine = GrammarEngine(byte_tokenizer, [EOS], cache_size=2)
    a, b, c = ({"type": "choice", "choices": [w]} for w in ("yes", "no", "abc"))
    engine.state(a), engine.state(b), engine.state(a), engine.state(c)  # c evicts b, the least recently used
    assert engine.compiles == 3
    engine.state(a)
    assert engine.compiles == 3
    engine.state(b)
    assert engine.compiles == 4


def test_one_engine_per_tokenizer(byte_tokenizer):
    assert grammar_engine(byte_tokenizer, [EOS]) is grammar_engine(byte_tokenizer, {EOS})


# ---------------------------------------------------------------- one row's matcher


def test_masks_follow_the_grammar_and_eos_only_where_it_accepts(engine, byte_tokenizer):
    state = engine.state(FORMS[3])  # yes | ye | no
    yes, ye, no, _y, _e, s = (ids(byte_tokenizer, w)[0] for w in ("yes", "ye", "no", "y", "e", "s"))
    first = allowed(state.mask())
    assert {yes, ye, no} <= first and EOS not in first
    assert state.speculate([ye]) == 1
    after_ye = allowed(state.mask())
    assert EOS in after_ye and s in after_ye  # "ye" is complete; "yes" may go on
    assert not state.is_finished()


def test_every_verify_position_gets_the_mask_of_its_prefix(engine, byte_tokenizer):
    form = FORMS[1]
    draft = ids(byte_tokenizer, '{"name": "ab", "age": 12}')
    state = engine.state(form)
    assert state.speculate(draft) == len(draft)
    masks = state.masks()
    assert masks.shape[0] == len(draft) + 1
    for j in range(len(draft) + 1):
        assert allowed(masks[j]) == fresh_mask(engine, form, draft[:j]), j
    assert allowed(masks[-1]) == {EOS}  # the object is closed: only EOS is left


def test_a_draft_is_cut_where_the_grammar_forbids_it(engine, byte_tokenizer):
    state = engine.state(FORMS[1])
    good = ids(byte_tokenizer, '{"name": "ab')
    assert state.speculate(good + ids(byte_tokenizer, '"}')) == len(good)  # "age" is required: no closing yet
    state.settle(0, None)
    bad = ids(byte_tokenizer, '{"age": 1')  # and "name" comes first
    assert state.speculate(bad) == 1
    assert state.masks().shape[0] == 2  # masks only for the allowed prefix and the position after it


def test_settle_rolls_back_to_the_accepted_prefix_then_takes_the_target_token(engine, byte_tokenizer):
    form = FORMS[1]
    draft = ids(byte_tokenizer, '{"name": "abc", "age": 7')
    state = engine.state(form)
    state.speculate(draft)
    a_tok = ids(byte_tokenizer, "a")[0]
    state.settle(4, a_tok)  # accepted '{"', 'name', '": ', '"'; the target wrote "a" where the draft had "abc"
    expected = draft[:4] + [a_tok]
    assert allowed(state.mask()) == fresh_mask(engine, form, expected)
    # a draft model pushes while it drafts; speculate then only extends the run
    b_tok = ids(byte_tokenizer, "b")[0]
    assert state.push(b_tok)
    assert state.speculate([b_tok, b_tok]) == 2
    state.settle(2, EOS)  # EOS ends the request and is never consumed
    assert allowed(state.mask()) == fresh_mask(engine, form, expected + [b_tok, b_tok])


def test_speculate_keeps_what_agrees_and_rewinds_the_rest(engine, byte_tokenizer):
    form = FORMS[1]
    first = ids(byte_tokenizer, '{"name": "ab", "age": 1')
    state = engine.state(form)
    assert state.speculate(first) == len(first)
    second = first[:4] + ids(byte_tokenizer, 'c", "age": 2')  # agrees for 4 tokens, then differs
    assert state.speculate(second) == len(second)
    assert [allowed(m) for m in state.masks()] == [fresh_mask(engine, form, second[:j]) for j in range(len(second) + 1)]
    assert state.speculate(second[:2]) == 2  # a shorter draft shortens the run
    assert state.masks().shape[0] == 3 and allowed(state.mask()) == fresh_mask(engine, form, second[:2])


def test_a_speculative_eos_ends_the_run(engine, byte_tokenizer):
    state = engine.state(FORMS[3])
    ye = ids(byte_tokenizer, "ye")[0]
    assert state.speculate([ye, EOS, ye]) == 2
    assert state.masks().shape[0] == 2  # positions of "ye" and of EOS; nothing follows EOS


def test_forced_tokens_are_the_chains_of_single_allowed_tokens(engine, byte_tokenizer):
    form = {
        "type": "json_schema",
        "json_schema": {
            "name": "p",
            "schema": {
                **PERSON,
                "properties": {"name": {"type": "string", "enum": ["abc"]}, "age": {"type": "integer"}},
            },
        },
    }
    state = engine.state(form)
    chain = state.forced(limit=100)
    assert byte_tokenizer.decode(chain) == '{"name": "abc", "age": '
    for j in range(len(chain)):
        assert fresh_mask(engine, form, chain[:j]) == {chain[j]}
    assert state.forced(limit=100) == []  # the age's digits are the model's to choose
    state.settle(len(chain), ids(byte_tokenizer, "7")[0])
    assert state.speculate(ids(byte_tokenizer, "}")) == 1
    state.settle(1, None)
    assert state.is_finished() and state.is_accepting()
    assert state.forced(limit=100) == [EOS]  # a complete grammar forces EOS


def test_forced_chains_respect_the_limit(engine):
    state = engine.state({"type": "choice", "choices": ["abcabc"]})
    assert len(state.forced(limit=1)) == 1
    assert len(state.forced(limit=5)) == 2  # extends the same speculative run


# ---------------------------------------------------------------- masking logits


def _reference_allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(bits.shape[:-1] + (vocab,), dtype=torch.bool)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in bits.shape[:-1]]).view(-1, bits.dim() - 1).tolist():
        for t in range(vocab):
            w = t // 32
            out[tuple(idx) + (t,)] = w < bits.shape[-1] and bool((int(bits[tuple(idx) + (w,)]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_sets_minus_inf_exactly_where_forbidden(device, dtype):
    gen = torch.Generator().manual_seed(0)
    words, vocab = 3, 100  # the model has 4 rows past the 96 tokens the masks cover: padding, never allowed
    bits = torch.randint(-(2**31), 2**31 - 1, (2, 3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[0, 0] = -1
    logits = torch.randn(2, 3, vocab, generator=gen).to(device=device, dtype=dtype)
    expected = _reference_allowed(bits, vocab).to(device)
    out = apply_bitmask(logits.clone(), bits)
    assert torch.equal(torch.isfinite(out), expected)
    assert torch.equal(out[expected], logits[expected])
    assert not bool(expected[0, 0, 96:].any())


def test_mask_logits_leaves_unconstrained_rows_alone(engine, byte_tokenizer):
    state = engine.state(FORMS[3])
    logits = torch.randn(3, 2, 70)  # 6 padding rows past the tokenizer's 64 tokens
    out = mask_logits(logits.clone(), [None, state, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = set(torch.nonzero(torch.isfinite(out[1, 0])).flatten().tolist())
    assert finite == allowed(state.mask())
    assert torch.isfinite(out[1, 1, :64]).all()  # past the row's speculative run: anything the tokenizer has
    assert not torch.isfinite(out[1, :, 64:]).any()  # padding rows are never allowed under a grammar


@pytest.mark.slow
def test_forced_tokens_on_the_real_tokenizer_are_its_own_tokenization(default_decoder):
    tok = default_decoder.tokenizer
    engine = grammar_engine(tok, [tok.eos_token_id])  # shared per tokenizer: other tests may have compiled FORMS[1]
    compiled_before = engine.compiles
    state = engine.state(FORMS[1])
    chain = state.forced(limit=100)
    assert tok.decode(chain) == '{"name":'
    assert chain == tok.encode('{"name": "Bob"')[: len(chain)]
    assert chain == engine.state(FORMS[1]).matcher.compute_ff_tokens()  # the engine's forced-token API agrees
    assert engine.compiles - compiled_before <= 1  # the second state came from the cache


# ---------------------------------------------------------------- grammars that match nothing


@pytest.mark.parametrize(
    "fmt, field",
    [
        ({"type": "regex", "pattern": "[a&&b]"}, "response_format.pattern"),
        ({"type": "regex", "pattern": r"[^\s\S]"}, "response_format.pattern"),
        ({"type": "regex", "pattern": r"ab[^\s\S]"}, "response_format.pattern"),
        ({"type": "lark", "grammar": "start: /[a&&b]/"}, "response_format.grammar"),
    ],
)
def test_a_grammar_that_matches_nothing_is_refused_without_a_tokenizer(fmt, field):
    """validate_grammar alone accepts these: a matcher over single bytes sees that nothing, not even EOS, is allowed."""
    with pytest.raises(InvalidParameterError, match=f"{field} matches no string at all"):
        parse_response_format(fmt)
    with pytest.raises(InvalidParameterError, match="matches no string at all"):
        SamplingParams(response_format=fmt)


@pytest.mark.parametrize("pattern", ["a|[^\\s\\S]", "[a-c]{0,2}", "x?"])
def test_grammars_that_match_something_still_pass(pattern):
    assert parse_response_format({"type": "regex", "pattern": pattern}) is not None


def test_the_engine_refuses_a_grammar_that_matches_nothing(engine):
    from spec_batch.core.structured.response_format import ResponseFormat

    with pytest.raises(InvalidParameterError, match="matches no string at all"):
        engine.matcher(ResponseFormat("regex", "[a&&b]"))  # built without parse_response_format's check
