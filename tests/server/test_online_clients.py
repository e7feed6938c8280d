"""The online endpoints through real clients against a real `spec-batch serve` process (one per module):
the official `openai` package and LangChain's ChatOpenAI.

- chat.completions.create without and with stream=True (the streamed deltas add up to the non-streamed greedy
  answer, which equals Decoder.generate's for the same chat), include_usage, usage.speculative;
- response_format json_schema and chat.completions.parse with a Pydantic model; tools -> tool_calls;
- completions.create, models.list / retrieve, 404 model_not_found, 401 without a key, 413 over the body limit;
- concurrent requests give what sequential ones give, and share the engine's steps;
- a streaming client that goes away frees its row (the in-progress gauge of /metrics drops);
- ChatOpenAI(base_url=...): invoke, stream, with_structured_output.
"""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from online_server import KEY, start_server
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPTS = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", "Write a haiku about rain."]


class Answer(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("online"))
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.output()  # uvicorn re-raises the signal once shut down


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0, **kw
    )


def test_chat_equals_decoder_and_reports_speculation(client, default_decoder):
    reply = _chat(client, CHAT[0]["content"])
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "default"
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    from spec_batch import SamplingParams

    direct = default_decoder.generate(
        [default_decoder.apply_chat_template(CHAT)], SamplingParams(max_new_tokens=MAX_TOKENS)
    )[0]
    assert choice.message.content == direct.text
    assert reply.usage.completion_tokens == direct.stats.output_tokens
    speculative = reply.usage.model_extra["speculative"]
    assert speculative["drafter"] == "ngram" and speculative["target_forwards"] >= 1


def test_stream_adds_up_to_the_same_answer(client):
    whole = _chat(client, PROMPTS[1]).choices[0].message.content
    chunks = list(_chat(client, PROMPTS[1], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_json_schema_and_parse(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    assert json.loads(reply.choices[0].message.content)["answer"] in ("yes", "no")
    parsed = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Is water wet? Answer in JSON."}],
        max_tokens=40,
        response_format=Answer,
    )
    assert isinstance(parsed.choices[0].message.parsed, Answer)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _weather(client, **kw):
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=60,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        **kw,
    )


def test_tools_give_tool_calls(client):
    reply = _weather(client)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)
    streamed = [c for c in _weather(client, stream=True) if c.choices]
    call = next(c.choices[0].delta.tool_calls[0] for c in streamed if c.choices[0].delta.tool_calls)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == (calls[0].function.name, calls[0].function.arguments)


def test_completions_and_models(client):
    reply = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.object == "text_completion" and reply.choices[0].text
    assert [m.id for m in client.models.list()] == ["default"]
    assert client.models.retrieve("default").id == "default"


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    assert err.value.code == "model_not_found" and err.value.body["param"] == "model"


def test_bad_body_is_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=7)
    assert err.value.body["param"] == "temperature"


def test_auth(server):
    anonymous = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert httpx.post(server.base_url + "/chat/completions", json={}).status_code == 401  # no key at all
    assert httpx.get(server.url + "/health").status_code == 200  # no user data: no key needed
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_body_limit(server):
    big = {"model": "default", "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    reply = httpx.post(
        server.base_url + "/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_concurrent_requests_equal_sequential(client):
    sequential = [_chat(client, p).choices[0].message.content for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(lambda p: _chat(client, p).choices[0].message.content, PROMPTS))
    assert concurrent == sequential


def _in_progress(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    values = re.findall(r"^spec_batch_requests_in_progress\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in values)


NO_EOS = {"0": -100, "2": -100}  # SmolLM2's <|endoftext|> and <|im_end|>: the answer runs to max_tokens


def _wait_idle(server, timeout: float = 20) -> float:
    deadline = time.monotonic() + timeout
    while _in_progress(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _in_progress(server)


def test_client_that_leaves_frees_its_row(server, client):
    stream = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=4000, stream=True, logit_bias=NO_EOS
    )
    for _, _chunk in zip(range(3), stream):
        pass
    assert _in_progress(server) == 1
    stream.close()  # the client goes away long before 4000 tokens (minutes here)
    assert _wait_idle(server) == 0
    assert "spec_batch_requests_total" in httpx.get(server.url + "/metrics").text
    body = {"model": "default", "messages": CHAT, "max_tokens": 4000, "logit_bias": NO_EOS}
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(
            server.base_url + "/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(5, read=1.5),
        )
    assert _wait_idle(server) == 0


def test_langchain_chat_openai(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.base_url, api_key=KEY, model="default", temperature=0, max_tokens=MAX_TOKENS, max_retries=0
    )
    whole = llm.invoke(PROMPTS[2]).content
    assert whole
    assert "".join(chunk.content for chunk in llm.stream(PROMPTS[2])) == whole
    structured = ChatOpenAI(
        base_url=server.base_url, api_key=KEY, model="default", temperature=0, max_tokens=40, max_retries=0
    ).with_structured_output(Answer)
    assert isinstance(structured.invoke("Is fire hot? Answer in JSON."), Answer)


# ---------------------------------------------------------------- a grammar the engine gives up on

ENGINE_DUMPS = ("<state>", "<grammar>", "<non-verbose/>", "lark_grammar")
# passes every check before decoding (nothing is forced at its start); after "b" or "c" the engine looks ahead
# through a million forced "a"s and gives up: a grammar that fails mid-decode
FAILS_MID_DECODE = {"type": "regex", "pattern": "(b|c)a{1000000}"}


@pytest.mark.parametrize(
    "form, param",
    [
        ({"type": "regex", "pattern": "a{1000000}"}, "response_format.pattern"),
        ({"type": "lark", "grammar": 'start: a\na: "x" a'}, "response_format.grammar"),
    ],
)
def test_a_grammar_past_the_engines_limits_is_a_400_before_decoding(client, form, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, response_format=form)
    error = info.value.body
    assert error["param"] == param and "exceeds the grammar engine's limits" in error["message"]
    assert not any(dump in json.dumps(error) for dump in ENGINE_DUMPS)


def test_a_grammar_failing_mid_decode_fails_its_request_alone(server, client):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPTS[3]}],
        "max_tokens": 48,
        "temperature": 0,
        "logit_bias": NO_EOS,
    }
    expected = client.chat.completions.create(**body).choices[0].message.content
    bad = {"model": "default", "messages": CHAT, "max_tokens": 20, "response_format": FAILS_MID_DECODE}
    other = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)  # another client
    stream = other.chat.completions.create(**body, stream=True)
    text = [chunk.choices[0].delta.content or "" for _, chunk in zip(range(3), stream)]
    with pytest.raises(openai.BadRequestError) as info:  # decoded in the same steps as the stream
        client.chat.completions.create(**bad)
    error = info.value.body
    assert error["param"] == "response_format" and error["code"] == "grammar_failed"
    assert "the grammar engine gave up" in error["message"]
    with pytest.raises(openai.APIError) as streamed:  # streamed: an error event, then the stream ends
        for _chunk in client.chat.completions.create(**bad, stream=True):
            pass
    assert "the grammar engine gave up" in streamed.value.message
    for message in (json.dumps(error), streamed.value.message):
        assert not any(dump in message for dump in ENGINE_DUMPS)
    rest = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert rest, "the other request finished before the failing ones ran beside it"
    assert "".join(text + rest) == expected
