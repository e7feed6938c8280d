"""Issue 38, defect 2: NUL (U+0000) in what a user sends, on SQLite and PostgreSQL alike (PostgreSQL refuses NUL in
text and JSONB; store/nul_safe.py escapes it there and restores it on the way out).

Through the official `openai` client on the app in process (the tiny model, NUL a token of its own; keys on), through `spec-batch run`
(the fake decoder, whose reply holds NUL), and the store's types directly: the batch is stored and decoded with its
NUL kept in prompts, custom_id, metadata, file names, stop strings, outputs and raw invalid lines; never a 500; a
job, its requests and its batch row appear together or not at all.
"""

from __future__ import annotations

import dataclasses
import json
import time

import openai
import pytest
from batch_lines import write_batch
from click.testing import CliRunner
from fastapi.testclient import TestClient

from spec_batch.server.app import create_app
from spec_batch.server.serve import ServeOptions, build_context
from spec_batch.settings import get_settings
from spec_batch.store import make_session_factory, open_store, queries
from spec_batch.store.models import Job
from spec_batch.store.nul_safe import ESC, escape_nul, restore_nul

KEY = "sk-nul"
PROMPT = "1 2 3 4 5 1 2 3"
ENDED = ("completed", "failed", "cancelled", "expired")


class NulTokenizer:
    """The fake tokenizer's ids (space-separated integers) where NUL is a word of its own, token 0 (decoded back to
    NUL), with a chat template: every message's content, then 9."""

    eos_token_id = pad_token_id = None
    chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}9"

    def encode(self, text: str, **kwargs) -> list[int]:
        return [0 if x == "\x00" else int(x) for x in text.replace("\x00", " \x00 ").split()]

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        return " ".join("\x00" if int(i) == 0 else str(int(i)) for i in ids)

    def __call__(self, text: str, **kwargs) -> dict:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        import jinja2

        return jinja2.Template(self.chat_template).render(messages=messages)


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder("ngram", tokenizer=NulTokenizer())


@pytest.fixture
def nul_reply(fake_decoder_cls):
    """The fake decoder (any character is a token), whose reply holds NUL and the escape character."""

    class NulReply(fake_decoder_cls):
        REPLY = "Hel\x00lo " + ESC + "0 there"

    return NulReply()


def make_app(decoder, url: str):
    base = dataclasses.replace(get_settings(), database_url=url, api_keys=(KEY,))
    factory = open_store(base.database_url, migrate=True)
    ctx = build_context(base, ServeOptions(target="tiny", draft="ngram"), factory, decoder=decoder)
    return create_app(ctx)


@pytest.fixture
def http(decoder, db_url):
    with TestClient(make_app(decoder, db_url), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def line(cid: str, prompt, url: str = "/v1/completions", **body) -> str:
    key = "messages" if url == "/v1/chat/completions" else "prompt"
    body = {"model": "tiny", key: prompt, "max_tokens": 4, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def wait(client, batch, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while batch.status not in ENDED:
        assert time.monotonic() < deadline, f"batch {batch.id} still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def lines_of(client, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def job_ids(url: str) -> set[str]:
    with make_session_factory(url)() as s:
        return set(s.scalars(Job.__table__.select().with_only_columns(Job.id)))


# ---------------------------------------------------------------- the escape itself


@pytest.mark.parametrize("text", ["", "plain", "a\x00b", "\x00", ESC, ESC + "0", ESC + "e\x00", "\x00" + ESC * 3])
def test_the_escape_round_trips_and_leaves_text_without_nul_alone(text):
    stored = escape_nul(text)
    assert "\x00" not in stored and restore_nul(stored) == text
    if "\x00" not in text and ESC not in text:
        assert stored is text


def test_nul_round_trips_in_every_text_and_json_column(db_url):
    """Through the ORM and Core on both backends, and lookups by a value with NUL still match."""
    factory = make_session_factory(db_url)
    weird = "a\x00b" + ESC + "c" + ESC + "0"
    with factory.begin() as s:
        queries.insert_job(
            s,
            id="job_nul",
            target="t",
            drafter="d",
            input_file=weird,
            sampling_defaults={"stop": [weird]},
            user_metadata={weird: weird},
            n_requests=1,
        )
        rows = [
            {
                "job_id": "job_nul",
                "custom_id": weird,
                "line_number": 1,
                "input": weird,
                "endpoint": "/v1/completions",
                "prompt": [{"role": "user", "content": weird}],
                "params": {"stop": [weird]},
                "options": {"tools": [{"name": weird}]},
                "status": "completed",
                "output": weird,
                "error": weird,
                "error_param": weird,
            }
        ]
        queries.insert_requests(s, rows)
    with factory() as s:
        job = queries.get_job(s, "job_nul")
        assert (job.input_file, job.sampling_defaults, job.user_metadata) == (weird, {"stop": [weird]}, {weird: weird})
        (req,) = job.requests
        for column in ("custom_id", "input", "output", "error", "error_param"):
            assert getattr(req, column) == weird, column
        assert req.prompt == rows[0]["prompt"] and req.params == rows[0]["params"]
        assert req.options == rows[0]["options"]
        from spec_batch.store.models import Request

        assert s.scalars(Request.__table__.select().where(Request.custom_id == weird)).first() is not None
        assert s.scalars(Request.__table__.select().where(Request.custom_id.in_([weird]))).first() is not None


# ---------------------------------------------------------------- the Batch API, through the openai client


def test_a_batch_with_nul_everywhere_runs_with_its_nul_kept(client):
    lines = [
        line("a\x00b", "1 2 \x00 3", stop=["\x00"]),
        line("c", "1 2 3 \x00 4"),
        line("bad\x00", "1 2", max_tokens=-1),  # a bad body value: fails alone, its error in the error file
    ]
    data = ("\n".join(lines) + "\n").encode()
    f = client.files.create(file=("in\x00.jsonl", data), purpose="batch")
    assert client.files.retrieve(f.id).filename == f.filename
    assert client.files.content(f.id).content == data
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"note\x00": "x\x00y"}
    )
    batch = wait(client, batch)
    assert batch.status == "completed" and batch.metadata == {"note\x00": "x\x00y"}
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 1
    done = {x["custom_id"]: x["response"]["body"] for x in lines_of(client, batch.output_file_id)}
    assert sorted(done) == ["a\x00b", "c"]
    assert "\x00" not in done["a\x00b"]["choices"][0]["text"]  # cut at its stop string
    (bad,) = lines_of(client, batch.error_file_id)
    assert bad["custom_id"] == "bad\x00" and bad["error"]
    assert client.batches.list().data[0].id == batch.id


def test_a_chat_batch_with_nul_in_content_runs(client):
    f = client.files.create(
        file=(
            "chat.jsonl",
            (line("k\x00", [{"role": "user", "content": "1 \x00 2"}], "/v1/chat/completions") + "\n").encode(),
        ),
        purpose="batch",
    )
    batch = wait(
        client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    )
    assert batch.status == "completed", batch
    assert [x["custom_id"] for x in lines_of(client, batch.output_file_id)] == ["k\x00"]


def test_a_file_failing_validation_with_nul_fails_cleanly(client):
    dup = line("d\x00", PROMPT)
    raw = '{"custom_id": "raw\x00", "body": \x00}'  # a raw 0x00 byte in a line that is not JSON
    f = client.files.create(file=("dup.jsonl", f"{dup}\n{dup}\n{raw}\n".encode()), purpose="batch")
    batch = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"))
    assert batch.status == "failed" and [e.line for e in batch.errors.data] == [2, 3]
    assert client.batches.retrieve(batch.id).errors == batch.errors


def test_ids_and_filters_with_nul_are_404s_or_empty_never_500s(client, http):
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_\x00")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-\x00")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-\x00", endpoint="/v1/completions", completion_window="24h")
    assert client.files.list(purpose="batch\x00").data == []


def test_a_job_its_requests_and_its_batch_are_one_transaction(http, client, db_url, monkeypatch):
    from spec_batch.server import batch_create

    def refuse(*args, **kwargs):
        raise RuntimeError("the batch row cannot be written")

    before = job_ids(db_url)
    f = client.files.create(file=("in.jsonl", (line("a", PROMPT) + "\n").encode()), purpose="batch")
    monkeypatch.setattr(batch_create.file_sql, "insert_batch", refuse)
    with pytest.raises(openai.InternalServerError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert job_ids(db_url) == before  # no job left in validating, no request rows


# ---------------------------------------------------------------- online


def test_an_online_completion_with_a_nul_prompt_is_no_500(http):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "1 2 \x00 3", "max_tokens": 3}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "1\x00"}], "max_tokens": 3},
        ),
    ):
        r = http.post(path, json=body, headers=auth)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.json()["usage"]["prompt_tokens"] == (4 if path == "/v1/completions" else 3)  # NUL is a token


# ---------------------------------------------------------------- spec-batch run


def test_spec_batch_run_stores_and_writes_nul(db_url, tmp_path, monkeypatch, nul_reply):
    from spec_batch.cli import _common, main
    from spec_batch.cli import jobs as cli_jobs

    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)
    monkeypatch.setattr(cli_jobs, "_load_decoder", lambda *a, **k: nul_reply)
    path = write_batch(
        tmp_path / "in.jsonl",
        [line("r\x001", "p \x00 1", max_tokens=50), line("r2", "p 2", max_tokens=50)] + ['{"custom_id": "x", \x00'],
    )
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--baseline-sample", "0"])
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {"r\x001", "r2"}
    assert got["r\x001"]["response"]["body"]["choices"][0]["text"] == nul_reply.REPLY
