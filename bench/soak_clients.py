"""The soak test's online clients (bench/soak_server.py), each a bounded loop that records every request in the
ledger: streaming chat (the official `openai` client), non-streaming chat with `tools` or a `json_schema`
response_format, streams that the client drops after a few chunks (raw httpx), and bad requests that must get
their 4xx with OpenAI's error body. Each request is checked as it ends: one choice, one finish reason, one
chunk id, usage within max_tokens; anything else is an error with its detail.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from bench.prompts import SETS
from bench.soak_monitor import Ledger, Record

PROMPTS = [p for name in ("edits", "free", "code", "json") for p in SETS[name]]

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
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 40}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Perth"]
QUESTIONS = ["Is the sky blue?", "Is water wet?", "Is 7 a prime number?", "Do fish fly?", "Is ice cold?"]


@dataclass
class Config:
    base_url: str
    key: str
    max_tokens: int
    deadline: float
    max_requests: int


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def client_loop(name: str, once: Callable[[random.Random], Record], cfg: Config, ledger: Ledger, pause: float):
    """Up to cfg.max_requests requests until cfg.deadline, each followed by a random pause of up to `pause` s."""
    rng = random.Random(name)
    for _ in range(cfg.max_requests):
        if time.monotonic() >= cfg.deadline:
            return
        t0 = time.monotonic()
        try:
            record = once(rng)
        except Exception as exc:  # a client's own bug must show, not kill the thread
            record = Record(name, t0, time.monotonic(), "error", detail="client: " + _err(exc))
        ledger.add(record)
        time.sleep(rng.uniform(0, pause))


def _sampling(rng: random.Random) -> dict:
    return {"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(1 << 30)}


# ---------------------------------------------------------------- streaming chat


def stream_problem(finishes: list[str], ids: set[str], usage, max_tokens: int) -> str:
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return f"finish reasons {finishes}"
    if len(ids) != 1:
        return f"{len(ids)} chunk ids"
    if usage is None:
        return "no usage chunk"
    if not 1 <= usage.completion_tokens <= max_tokens:
        return f"completion_tokens {usage.completion_tokens}"
    if finishes[0] == "length" and usage.completion_tokens != max_tokens:
        return f"length after {usage.completion_tokens} of {max_tokens} tokens"
    return ""


def streaming_once(client, cfg: Config) -> Callable[[random.Random], Record]:
    def once(rng: random.Random) -> Record:
        t0 = time.monotonic()
        finishes, ids, usage = [], set(), None
        try:
            stream = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": rng.choice(PROMPTS)}],
                max_tokens=cfg.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                **_sampling(rng),
            )
            for chunk in stream:
                ids.add(chunk.id)
                usage = chunk.usage or usage
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
        except Exception as exc:
            return Record("stream", t0, time.monotonic(), "error", detail=_err(exc))
        problem = stream_problem(finishes, ids, usage, cfg.max_tokens)
        tokens = usage.completion_tokens if usage else 0
        return Record("stream", t0, time.monotonic(), "error" if problem else "complete", tokens, problem)

    return once


# ---------------------------------------------------------------- tools and json_schema


def _tools_request(rng: random.Random) -> tuple[dict, str]:
    return {
        "messages": [{"role": "user", "content": f"What is the weather in {rng.choice(CITIES)}?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }, "tools"


def _schema_request(rng: random.Random) -> tuple[dict, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    content = rng.choice(QUESTIONS) + " Answer in JSON."
    return {"messages": [{"role": "user", "content": content}], "response_format": fmt}, "json_schema"


def answer_problem(reply, kind: str, max_tokens: int) -> str:
    if len(reply.choices) != 1 or reply.usage is None:
        return f"{len(reply.choices)} choices, usage {reply.usage}"
    choice, used = reply.choices[0], reply.usage.completion_tokens
    if not 1 <= used <= max_tokens:
        return f"completion_tokens {used}"
    if choice.finish_reason == "length":
        return "" if used == max_tokens else f"length after {used} tokens"
    if kind == "tools":
        calls = choice.message.tool_calls or []
        if choice.finish_reason != "tool_calls" or len(calls) != 1:
            return f"finish {choice.finish_reason}, {len(calls)} tool calls"
        return "" if "city" in json.loads(calls[0].function.arguments) else "no city in the arguments"
    if choice.finish_reason != "stop":
        return f"finish {choice.finish_reason}"
    return "" if json.loads(choice.message.content)["answer"] in ("yes", "no") else "answer outside the enum"


def structured_once(client, cfg: Config) -> Callable[[random.Random], Record]:
    def once(rng: random.Random) -> Record:
        body, kind = _tools_request(rng) if rng.random() < 0.5 else _schema_request(rng)
        t0 = time.monotonic()
        try:
            reply = client.chat.completions.create(model="default", max_tokens=cfg.max_tokens, temperature=0, **body)
            problem = answer_problem(reply, kind, cfg.max_tokens)
        except Exception as exc:
            return Record(kind, t0, time.monotonic(), "error", detail=_err(exc))
        tokens = reply.usage.completion_tokens if reply.usage else 0
        return Record(kind, t0, time.monotonic(), "error" if problem else "complete", tokens, problem)

    return once


# ---------------------------------------------------------------- clients that go away mid-stream


def disconnect_once(http: httpx.Client, cfg: Config) -> Callable[[random.Random], Record]:
    """Streams a long answer and closes the connection after 1-3 chunks of text; an answer that ends first must
    end as a whole stream (one finish reason, then [DONE])."""

    def once(rng: random.Random) -> Record:
        body = {"model": "default", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True}
        body["max_tokens"] = max(cfg.max_tokens, 48)
        keep, seen, finishes, done = rng.randint(1, 3), 0, 0, False
        t0 = time.monotonic()
        with http.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Record("disconnect", t0, time.monotonic(), "error", detail=f"HTTP {response.status_code}")
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    finishes += sum(bool(c.get("finish_reason")) for c in chunk.get("choices", []))
                    seen += any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))
                if seen >= keep and not done and not finishes:
                    return Record("disconnect", t0, time.monotonic(), "cancelled")  # leaving `with` closes it
        whole = done and finishes == 1
        return Record("disconnect", t0, time.monotonic(), "complete" if whole else "error", 0, f"{finishes} finishes")

    return once


# ---------------------------------------------------------------- bad requests

_CHAT = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [  # name, method, path, JSON body (or bytes), expected status
    ("unknown_field", "POST", "/chat/completions", {"messages": _CHAT, "max_tokens": 4, "frobnicate": 1}, 400),
    ("bad_temperature", "POST", "/chat/completions", {"messages": _CHAT, "max_tokens": 4, "temperature": -1}, 400),
    ("unknown_model", "POST", "/chat/completions", {"model": "no-such-model", "messages": _CHAT}, 404),
    ("not_json", "POST", "/chat/completions", b'{"messages": [', 400),
    ("no_messages", "POST", "/chat/completions", {"model": "default", "max_tokens": 4}, 400),
    ("huge_max_tokens", "POST", "/chat/completions", {"messages": _CHAT, "max_tokens": 10**9}, 400),
    ("bad_response_format", "POST", "/chat/completions", {"messages": _CHAT, "response_format": {"type": "x"}}, 400),
    ("unknown_batch", "GET", "/batches/batch_nosuchbatch", None, 404),
    ("unknown_file", "GET", "/files/file-nosuchfile/content", None, 404),
    ("wrong_key", "GET", "/models", None, 401),
]


def bad_once(http: httpx.Client) -> Callable[[random.Random], Record]:
    def once(rng: random.Random) -> Record:
        name, method, path, body, expected = rng.choice(BAD_REQUESTS)
        kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
        if name == "wrong_key":
            kw["headers"] = {"Authorization": "Bearer sk-wrong"}
        t0 = time.monotonic()
        response = http.request(method, path, **kw)
        ok = response.status_code == expected and "message" in response.json().get("error", {})
        detail = "" if ok else f"{name}: HTTP {response.status_code} (expected {expected}) {response.text[:200]}"
        return Record("bad:" + name, t0, time.monotonic(), "complete" if ok else "error", 0, detail)

    return once
