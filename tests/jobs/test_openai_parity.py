"""OpenAI request parity: fields accepted and recorded, penalties/logit_bias/logprobs parsed into
SamplingParams, tools, n > 1 with per-choice seeds, and the output choices rendered in OpenAI's shape."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from spec_batch.core.outputs import GenerationResult, RequestStats
from spec_batch.core.params import SamplingParams
from spec_batch.jobs.batch_output import output_line
from spec_batch.jobs.choices import Choices, choice_seed, expand
from spec_batch.openai_format import CHAT, COMPLETIONS, BodyError, parse_body

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_fields_that_change_nothing_are_accepted_and_recorded():
    recorded = {
        "user": "u",
        "store": True,
        "metadata": {"k": "v"},
        "service_tier": "flex",
        "stream_options": {"include_usage": True},
        "parallel_tool_calls": True,
    }
    body = parse_body(CHAT, {"messages": MESSAGES, **recorded})
    assert body.recorded == recorded and body.options() == {"recorded": recorded}
    assert parse_body(CHAT, {"messages": MESSAGES}).options() is None  # nothing to keep: the column stays NULL


@pytest.mark.parametrize(
    "extra,param,problem",
    [
        ({"frobnicate": 1}, "frobnicate", "unsupported field"),
        ({"metadata": {"k": 1}}, "metadata.k", "strings"),
        ({"store": "yes"}, "store", "true or false"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
        ({"logit_bias": {"7": 101}}, "logit_bias.7", "[-100, 100]"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"n": 129}, "n", "[1, 128]"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "letters"),
    ],
)
def test_a_bad_or_unknown_field_is_an_error_naming_it(extra, param, problem):
    with pytest.raises(BodyError) as exc:
        parse_body(CHAT, {"messages": MESSAGES, **extra})
    assert exc.value.param == param and problem in str(exc.value)


def test_penalties_logit_bias_and_logprobs_reach_sampling_params():
    p = parse_body(
        CHAT,
        {
            "messages": MESSAGES,
            "frequency_penalty": 0.5,
            "presence_penalty": -1,
            "logit_bias": {"5": 10, "9": -100},
            "logprobs": True,
            "top_logprobs": 3,
        },
    ).params
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias) == (0.5, -1.0, {5: 10.0, 9: -100.0})
    assert (p.logprobs, p.top_logprobs) == (True, 3)
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p  # stored and read back
    c = parse_body(COMPLETIONS, {"prompt": "x", "logprobs": 2}).params
    assert (c.logprobs, c.top_logprobs) == (True, 2)


def test_tools_put_the_call_grammar_and_the_tools_prompt_into_the_request():
    body = parse_body(CHAT, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"})
    assert body.params.response_format.type == "json_schema" and "get_weather" in body.prompt[0]["content"]
    assert body.options() == {"tools": {"tool_choice": "any", "tools": ["get_weather"]}}
    none = parse_body(CHAT, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"})
    assert none.params.response_format is None and none.prompt == MESSAGES


def test_choices_of_a_seeded_request_have_reproducible_distinct_seeds():
    params = SamplingParams(temperature=1.0, seed=7)
    seeds = [p.seed for p in expand(params, 4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4 and seeds == [p.seed for p in expand(params, 4)]
    assert all(0 <= s < 2**63 for s in seeds) and choice_seed(None, 3) is None


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _result(text, finish="stop", logprobs=None, tokens=2):
    stats = RequestStats(prompt_tokens=5, output_tokens=tokens, target_forwards=tokens)
    result = GenerationResult(text, [ord(c) for c in text], finish, stats)
    if logprobs is not None:
        result.logprobs = logprobs  # GenerationResult.logprobs (the core's contract), set as the core does
    return result


def _row(endpoint, result, records, options=None):
    s = result.stats
    return SimpleNamespace(
        id=3,
        custom_id="c",
        endpoint=endpoint,
        output=result.text,
        finish_reason=result.finish_reason,
        choices=records,
        options=options,
        prompt_tokens=s.prompt_tokens,
        output_tokens=s.output_tokens,
        draft_tokens=0,
        accepted_tokens=0,
        target_forwards=s.target_forwards,
        draft_forwards=0,
        forced_tokens=0,
        accepted_length_histogram=[],
        wall_s=0.5,
        completed_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


def test_n_choices_with_logprobs_render_in_openai_shapes():
    top = lambda c: SimpleNamespace(token_id=ord(c), logprob=-0.5, top=[(ord(c), -0.5), (ord("z"), -1.5)])
    for endpoint, model in ((CHAT, ChatCompletion), (COMPLETIONS, Completion)):
        choices = Choices(CharTokenizer())
        choices.expect(3, 2)
        assert choices.add(3, 1, _result("yo", logprobs=[top("y"), top("o")])) is None  # choice 0 still due
        merged, records = choices.add(3, 0, _result("hi", logprobs=[top("h"), top("i")]))
        assert merged.text == "hi" and merged.stats.output_tokens == 4 and merged.stats.prompt_tokens == 5
        body = output_line(_row(endpoint, merged, records), model="m", drafter="ngram")["response"]["body"]
        parsed = model.model_validate(body)
        assert [c.index for c in parsed.choices] == [0, 1] and body["usage"]["completion_tokens"] == 4
        if endpoint == CHAT:
            content = parsed.choices[1].logprobs.content
            assert [t.token for t in content] == ["y", "o"] and content[0].top_logprobs[1].token == "z"
            assert content[0].bytes == [ord("y")]
        else:
            lp = parsed.choices[0].logprobs
            assert lp.tokens == ["h", "i"] and lp.text_offset == [0, 1] and lp.top_logprobs[0] == {"h": -0.5, "z": -1.5}


def test_a_tool_call_answer_becomes_tool_calls_with_finish_reason_tool_calls():
    options = {"tools": {"tool_choice": "auto", "tools": ["get_weather"]}}
    call = _result('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    body = output_line(_row(CHAT, call, None, options), model="m", drafter="ngram")["response"]["body"]
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    text = output_line(_row(CHAT, _result("It is sunny."), None, options), model="m", drafter="ngram")
    assert text["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}


def test_stream_is_a_field_of_online_requests_only():
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    online = parse_body(CHAT, body, online=True)
    assert online.stream is True and online.recorded == {"stream_options": {"include_usage": True}}
    with pytest.raises(BodyError) as exc:  # a batch line cannot stream
        parse_body(CHAT, body)
    assert exc.value.param == "stream" and exc.value.code == "unsupported_field"
