"""The online routes in process (FastAPI's TestClient, the app's lifespan running the engine) over the tiny random
model, fast: /v1/completions' choices, n > 1, logprobs, the SSE stream (chunks add up to the answer, include_usage,
[DONE]), the errors (model_not_found, a field named, a prompt too long, no chat template, a chunked body over the
limit), /v1/models and /metrics."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from spec_batch import SamplingParams
from spec_batch.server.app import create_app
from spec_batch.server.body_limit import DEFAULT_MAX_BODY_BYTES
from spec_batch.server.serve import ServeOptions, build_context
from spec_batch.settings import get_settings

PROMPT = "1 2 3 4 5 1 2 3"


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder("ngram")


@pytest.fixture(scope="module")
def client(decoder):
    ctx = build_context(get_settings(), ServeOptions(target="tiny", draft="ngram"), None, decoder=decoder)  # type: ignore[arg-type]
    with TestClient(create_app(ctx)) as c:
        yield c


def _complete(client, **body):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 10, **body})


def _events(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_completion_equals_generate(client, decoder):
    body = _complete(client).json()
    expected = decoder.generate([PROMPT], SamplingParams(max_new_tokens=10))[0]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == expected.text and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 10 and body["usage"]["speculative"]["drafter"] == "ngram"


def test_n_and_logprobs(client):
    body = _complete(client, n=3, temperature=1.0, seed=5, logprobs=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 30  # every choice's tokens
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 10 and all(len(t) <= 2 for t in lp["top_logprobs"])


def test_stream_adds_up_with_usage(client):
    whole = _complete(client).json()["choices"][0]["text"]
    chunks = _events(_complete(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert len({c["id"] for c in chunks}) == 1


def test_stream_n_interleaves_by_index(client):
    chunks = _events(_complete(client, stream=True, n=2))
    finals = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finals) == [0, 1]


@pytest.mark.parametrize(
    "body,status,code,param",
    [
        ({"model": "gpt-4o"}, 404, "model_not_found", "model"),
        ({"temperature": 9}, 400, "invalid_value", "temperature"),
        ({"best_of": 2}, 400, "unsupported_field", "best_of"),
        ({"max_tokens": 10**6}, 400, "invalid_request", None),
    ],
)
def test_errors(client, body, status, code, param):
    reply = _complete(client, **body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == param and error["message"]


def test_chat_without_a_template_is_400(client):
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "chat_template_error"


def test_invalid_json_and_chunked_body_over_the_limit(client):
    assert client.post("/v1/completions", content=b"{nope").json()["error"]["code"] == "invalid_json"
    deep = client.post("/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"

    def chunks():
        for _ in range(DEFAULT_MAX_BODY_BYTES // (1 << 20) + 1):
            yield b" " * (1 << 20)

    reply = client.post("/v1/completions", content=chunks())  # no Content-Length: counted as it arrives
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_models_and_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/v1/models/default").json()["id"] == "tiny"
    assert client.get("/v1/models/other").status_code == 404
    metrics = client.get("/metrics").text
    assert 'spec_batch_requests_total{drafter="ngram",status="completed",target="tiny"}' in metrics


def test_concurrent_requests_share_steps(client, decoder):
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["1 2 3", "4 5 6 7", "8 9", "10 11 12 13 14"]
    expected = [r.text for r in decoder.generate(prompts, SamplingParams(max_new_tokens=200))]
    engine = client.app.state.ctx.engine
    engine.most_rows = 0
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(
            pool.map(lambda p: client.post("/v1/completions", json={"prompt": p, "max_tokens": 200}), prompts)
        )
    assert [r.json()["choices"][0]["text"] for r in replies] == expected
    assert engine.most_rows > 1  # requests from different clients decoded in the same steps
