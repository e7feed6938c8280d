"""Issue 38's lows and the Batch API as users meet it, through the official `openai` client (and LangChain's
`OpenAI`) on the app in process (FastAPI's TestClient as the client's transport, the app's lifespan running the
engine and the batch runner) over the tiny random model, SQLite, keys on:

- a lone surrogate in a request is a 400 naming the field, and a batch line with one fails alone as a client error;
- /v1/completions takes a list of prompts (strings or token ids), one choice per prompt and n;
- a message's `name` is accepted; /docs, /redoc and /openapi.json are off unless asked;
- a batch's result files resolve only when the batch names them; files list in order=asc; model_not_found's text;
- the batch object's `usage`, its result files in GET /v1/files, what deleting one means.
"""

from __future__ import annotations

import dataclasses
import json
import time

import openai
import pytest
from fastapi.testclient import TestClient

from spec_batch.server.app import create_app
from spec_batch.server.serve import ServeOptions, build_context
from spec_batch.settings import get_settings
from spec_batch.store import open_store

KEY = "sk-hardening"
PROMPT = "1 2 3 4 5 1 2 3"
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder("ngram")


def make_app(decoder, db_path, **settings):
    base = dataclasses.replace(get_settings(), database_url=f"sqlite:///{db_path}", api_keys=(KEY,), **settings)
    factory = open_store(base.database_url, migrate=True)
    ctx = build_context(base, ServeOptions(target="tiny", draft="ngram"), factory, decoder=decoder)
    return create_app(ctx)


@pytest.fixture(scope="module")
def http(decoder, tmp_path_factory):
    with TestClient(make_app(decoder, tmp_path_factory.mktemp("api") / "api.db")) as c:
        yield c


def client_of(http, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def client(http):
    return client_of(http)


def completion_line(cid: str, prompt, max_tokens: int = 6, **body) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def run_batch(client, lines: list[str], endpoint: str = "/v1/completions", timeout: float = 120.0, **kw):
    f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)
    deadline = time.monotonic() + timeout
    while batch.status not in ENDED:
        assert time.monotonic() < deadline, f"batch {batch.id} still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


# ---------------------------------------------------------------- Low 6, Low 7


def test_a_failed_batchs_result_files_are_404s(client):
    batch = run_batch(client, ["{not json", '{"custom_id": "x"}'])
    assert batch.status == "failed" and batch.output_file_id is None and batch.error_file_id is None
    for suffix in ("output", "errors"):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(f"file-{batch.id}-{suffix}")
        with pytest.raises(openai.NotFoundError):
            client.files.content(f"file-{batch.id}-{suffix}")


def test_a_completed_batch_without_errors_has_no_errors_file(client):
    batch = run_batch(client, [completion_line("a", PROMPT)])
    assert batch.status == "completed" and batch.output_file_id and batch.error_file_id is None
    assert lines_of(client, batch.output_file_id)[0]["custom_id"] == "a"
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f"file-{batch.id}-errors")


def test_unknown_model_names_the_served_one_once(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    message = err.value.body["message"]
    assert "serves 'tiny' (also called 'default')" in message and "(or 'default')" not in message


def test_files_list_honours_order(client):
    ids = [client.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(3)]
    newest_first = [f.id for f in client.files.list(purpose="batch", order="desc") if f.id in ids]
    oldest_first = [f.id for f in client.files.list(purpose="batch", order="asc") if f.id in ids]
    assert newest_first == ids[::-1] and oldest_first == ids
    page = client.files.list(purpose="batch", order="asc", after=ids[0], limit=1)
    assert [f.id for f in page.data] == [ids[1]]


# ---------------------------------------------------------------- Low 5


def test_docs_and_schema_are_off_unless_asked(http, decoder, tmp_path):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(path).status_code == 404, path  # no key, and none would help: they are not served
        assert http.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404, path
    with TestClient(make_app(decoder, tmp_path / "docs.db", api_docs=True)) as asked:
        assert asked.get("/openapi.json").json()["info"]["title"] == "spec-batch"
        assert asked.get("/docs").status_code == 200 and asked.get("/redoc").status_code == 200
        assert asked.get("/v1/models").status_code == 401  # the API itself still needs a key


# ---------------------------------------------------------------- Low 2


def test_a_lone_surrogate_is_a_400_naming_the_field(http):
    """Sent as JSON escapes ("\\ud800"), as curl or any client that writes ASCII JSON does (the `openai` client
    itself cannot encode such text)."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bodies = [
        ("/v1/completions", {"prompt": "hi \ud800 there", "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a \udfff"}]}], "max_tokens": 2},
            "messages[0].content[0].text",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["\ud83d"]}, "stop[0]"),
    ]
    for url, body, param in bodies:
        reply = http.post(url, content=json.dumps(body), headers=headers)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "lone surrogate" in error["message"] and error["code"] == "invalid_value"


def test_a_batch_line_with_a_lone_surrogate_fails_alone_as_a_client_error(client):
    batch = run_batch(client, [completion_line("ok", PROMPT), completion_line("bad", "hi \ud800 there")])
    assert batch.status == "completed" and batch.request_counts.completed == 1
    (error,) = [e["error"] for e in lines_of(client, batch.error_file_id)]
    assert (error["line"], error["code"], error["param"]) == (2, "invalid_value", "body.prompt")
    assert "lone surrogate" in error["message"]
    # in the envelope, a bad custom_id fails the file at validating (OpenAI's contract), naming the line
    batch = run_batch(client, [completion_line("ok", PROMPT), completion_line("bad-\udc00", PROMPT)])
    assert batch.status == "failed"
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [(2, "invalid_value", "custom_id")]


# ---------------------------------------------------------------- Low 4


class TemplateTokenizer:
    """The fake tokenizer's ids (space-separated integers) with a Jinja chat template; `reads_name`: the template
    writes token 7 before the content of a message that has a name (as templates that know names do)."""

    def __init__(self, base, reads_name: bool):
        self.base = base
        name = "{% if m.name %}7 {% endif %}" if reads_name else ""
        self.chat_template = "{% for m in messages %}" + name + "{{ m.content }} {% endfor %}9"

    def __getattr__(self, attr):
        return getattr(self.base, attr)

    def __call__(self, text, **kwargs):
        return self.base(text, **kwargs)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        import jinja2

        return jinja2.Template(self.chat_template).render(messages=messages)


@pytest.mark.parametrize("reads_name", [True, False])
def test_a_messages_name_goes_to_the_chat_template(tiny_decoder, fake_tokenizer, tmp_path, reads_name):
    decoder = tiny_decoder("ngram", tokenizer=TemplateTokenizer(fake_tokenizer, reads_name))
    with TestClient(make_app(decoder, tmp_path / "chat.db")) as http:
        chat = client_of(http).chat.completions

        def prompt_tokens(**named) -> int:
            messages = [{"role": "system", "content": "4 5", **named}, {"role": "user", "content": "1 2 3", **named}]
            reply = chat.create(model="tiny", messages=messages, max_tokens=2)
            return reply.usage.prompt_tokens

        plain, named = prompt_tokens(), prompt_tokens(name="ann")
    assert plain == 6 and named == (8 if reads_name else 6)


# ---------------------------------------------------------------- Low 3

PROMPTS = ["1 2 3 4 1 2", "5 6 7 5 6", "8 9 8 9 8"]


def test_completions_take_a_list_of_prompts_one_choice_each(client, decoder):
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=5) for p in PROMPTS]
    together = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=5)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [[int(t) for t in p.split()] for p in PROMPTS]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5)
    assert [c.text for c in by_ids.choices] == [c.text for c in together.choices]
    one = client.completions.create(model="tiny", prompt=[PROMPTS[0]], max_tokens=5)
    assert [c.text for c in one.choices] == [alone[0].choices[0].text]


def test_a_list_of_prompts_with_n_orders_choices_prompt_by_prompt(client):
    kw = dict(model="tiny", max_tokens=4, n=2, temperature=1.0, seed=3)
    alone = [client.completions.create(prompt=p, **kw) for p in PROMPTS[:2]]
    together = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert [c.index for c in together.choices] == [0, 1, 2, 3]  # prompt k's choice j: k * n + j
    assert [c.text for c in together.choices] == [c.text for a in alone for c in a.choices]
    streamed = client.completions.create(prompt=PROMPTS[:2], stream=True, **kw)
    texts: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [c.text for c in together.choices]


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([], "prompt"), (["a", [1]], "prompt"), (["1 2", ""], "prompt[1]"), ([[1], [-2]], "prompt[1][0]")],
)
def test_bad_prompt_lists_name_the_prompt(client, prompt, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert err.value.body["param"] == param


def test_langchain_openai_llm_sends_a_list_and_gets_its_answer(http, client):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEY, model="tiny", max_tokens=5, temperature=0, http_client=http
    )
    expected = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert llm.invoke(PROMPTS[0]) == expected.choices[0].text
    assert [g[0].text for g in llm.generate(PROMPTS[:2]).generations] == [
        client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0).choices[0].text
        for p in PROMPTS[:2]
    ]


def test_a_batch_line_takes_a_list_of_prompts(client):
    alone = run_batch(client, [completion_line(f"r{k}", p, max_tokens=5) for k, p in enumerate(PROMPTS)])
    together = run_batch(client, [completion_line("all", PROMPTS, max_tokens=5)])
    assert together.status == "completed" and together.request_counts.completed == 1
    (line,) = lines_of(client, together.output_file_id)
    body = line["response"]["body"]
    expected = [x["response"]["body"] for x in lines_of(client, alone.output_file_id)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [e["choices"][0]["text"] for e in expected]
    assert body["usage"]["prompt_tokens"] == sum(e["usage"]["prompt_tokens"] for e in expected)


# ---------------------------------------------------------------- the batch object's usage


def test_a_batch_carries_usage_beside_speculative(client):
    batch = run_batch(client, [completion_line(f"r{k}", p, max_tokens=5) for k, p in enumerate(PROMPTS)])
    usages = [x["response"]["body"]["usage"] for x in lines_of(client, batch.output_file_id)]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.model_extra["speculative"]["output_tokens"] == batch.usage.output_tokens


# ---------------------------------------------------------------- result files in the Files API


def test_result_files_are_listed_and_deleting_one_makes_it_unresolvable(http):
    client = client_of(http, key=KEY)
    batch = run_batch(client, [completion_line("ok", PROMPT), completion_line("bad", PROMPT, max_tokens=0)])
    out, err = batch.output_file_id, batch.error_file_id
    assert out and err
    listed = {f.id: f for f in client.files.list(purpose="batch_output")}
    assert {out, err} <= set(listed) and listed[out].purpose == "batch_output"
    assert listed[out].bytes == len(client.files.content(out).content) > 0
    everything = [f.id for f in client.files.list()]  # uploads and results together, newest first
    assert out in everything and batch.input_file_id in everything
    assert everything.index(out) < everything.index(batch.input_file_id)
    deleted = client.files.delete(out)
    assert deleted.deleted and deleted.id == out
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(out)
    after = client.batches.retrieve(batch.id)
    assert after.output_file_id is None and after.error_file_id == err  # the other file stays
    assert after.request_counts.completed == 1  # the rows stay until the batch goes
    assert out not in {f.id for f in client.files.list(purpose="batch_output")}


# ---------------------------------------------------------------- completion_window: expired


def housekeeping_of(http):
    from spec_batch.server.housekeeping import Housekeeping

    return next(s for s in http.app.state.ctx.services if isinstance(s, Housekeeping))


def test_a_batch_not_finished_within_its_window_ends_expired_with_what_was_done(decoder, tmp_path, monkeypatch):
    import threading
    from datetime import timedelta

    from spec_batch.server import batch_runner
    from spec_batch.store.models import utcnow

    app = make_app(decoder, tmp_path / "expiry.db")
    window_ended = threading.Event()
    original = batch_runner._Stoppable.generate

    def held(self, *args, **kwargs):
        # Once a request is done the runner waits until the test has seen the window end: otherwise a fast machine
        # finishes all 120 before the keeper's next tick and the batch completes instead of expiring.
        if batch_id is not None and _done(http, batch_id) >= 1:
            window_ended.wait(120)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(batch_runner._Stoppable, "generate", held)
    batch_id = None
    with TestClient(app) as http:
        keeper, shift = housekeeping_of(http), timedelta(0)
        keeper.interval_s, keeper.clock = 0.05, lambda: utcnow() + shift
        client = client_of(http)
        lines = [completion_line(f"r{i}", f"{i % 9 + 1} 2 3 4 5", max_tokens=60) for i in range(120)]
        f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        batch_id = batch.id
        assert batch.expires_at == batch.created_at + 24 * 3600
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        shift = timedelta(hours=25)  # a day later: the window has ended
        while (batch := client.batches.retrieve(batch.id)).status != "expired":
            assert time.monotonic() < deadline, batch.status
            time.sleep(0.05)
        window_ended.set()
        while _open(http, batch.id):  # the rows the runner held settle as expired too
            assert time.monotonic() < deadline
            time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.expired_at and batch.expired_at >= batch.created_at + 24 * 3600
    done, failed = batch.request_counts.completed, batch.request_counts.failed
    assert done >= 1 and failed >= 1 and done + failed == 120
    outputs, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert len(outputs) == done and len(errors) == failed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert {x["custom_id"] for x in outputs + errors} == {f"r{i}" for i in range(120)}
    # the CLI's exit code of an expired job (docs/jobs.md): 6, for wait and resume alike
    from click.testing import CliRunner

    from spec_batch.cli import main

    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'expiry.db'}")
    waited = CliRunner().invoke(main, ["wait", batch.id, "-q"])
    assert waited.exit_code == 6 and waited.stdout.strip() == "expired", waited.output
    resumed = CliRunner().invoke(main, ["resume", batch.id])
    assert resumed.exit_code != 0 and "expired" in resumed.output, resumed.output


def _done(http, batch_id: str) -> int:
    from spec_batch.store import queries

    with http.app.state.ctx.session_factory() as s:
        return queries.job_counts(s, batch_id)["completed"]


def _open(http, batch_id: str) -> int:
    from spec_batch.store import queries

    with http.app.state.ctx.session_factory() as s:
        counts = queries.job_counts(s, batch_id)
    return counts["pending"] + counts["running"]


# ---------------------------------------------------------------- retention


def test_retention_deletes_old_files_and_ended_batches(decoder, tmp_path, monkeypatch):
    from datetime import timedelta

    from click.testing import CliRunner

    from spec_batch.cli import main
    from spec_batch.store.models import utcnow

    db = tmp_path / "retention.db"
    with TestClient(make_app(decoder, db)) as http:
        client = client_of(http)
        old = run_batch(client, [completion_line("a", PROMPT)])
        keeper = housekeeping_of(http)
        keeper.ctx.settings = dataclasses.replace(keeper.ctx.settings, retention_days=2)
        keeper.clock = lambda: utcnow() + timedelta(days=1)
        keeper.tick()  # a day later: nothing is older than two days
        assert client.batches.retrieve(old.id).status == "completed"
        keeper.clock, keeper._pruned_at = (lambda: utcnow() + timedelta(days=3)), None
        keeper.tick()  # three days later: the batch, its files and its job are gone
        for call, ident in ((client.batches.retrieve, old.id), (client.files.retrieve, old.input_file_id)):
            with pytest.raises(openai.NotFoundError):
                call(ident)
        with pytest.raises(openai.NotFoundError):
            client.files.content(old.output_file_id)
        new = run_batch(client, [completion_line("b", PROMPT)])
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", f"sqlite:///{db}")
    monkeypatch.delenv("SPEC_BATCH_RETENTION_DAYS", raising=False)
    refused = CliRunner().invoke(main, ["db", "prune"])
    assert refused.exit_code == 1 and "no retention is set" in refused.output
    kept = CliRunner().invoke(main, ["db", "prune", "--older-than", "1"])  # what is a day old goes, nothing newer
    assert kept.exit_code == 0 and "deleted 0 files and 0 batches" in kept.output, kept.output
    monkeypatch.setenv("SPEC_BATCH_RETENTION_DAYS", "0.00001")  # a second: the new batch is older than that
    time.sleep(1.5)
    pruned = CliRunner().invoke(main, ["db", "prune"])
    assert pruned.exit_code == 0 and "deleted 1 files and 1 batches" in pruned.output, pruned.output
    with TestClient(make_app(decoder, db)) as http:
        with pytest.raises(openai.NotFoundError):
            client_of(http).batches.retrieve(new.id)


# ---------------------------------------------------------------- Low 1: a job left validating


def test_a_job_left_validating_fails_after_the_stated_age_and_a_young_one_stays(decoder, tmp_path):
    """What a server killed while validating left with the old three transactions (a job, some rows, no batch
    row): housekeeping fails it once it is older than SPEC_BATCH_STALE_VALIDATING_S; `spec-batch jobs` then lists it
    failed. A batch made now is stored in one transaction, so POST /v1/batches never leaves one."""
    from datetime import timedelta

    from click.testing import CliRunner

    from spec_batch.cli import main
    from spec_batch.store import queries
    from spec_batch.store.models import utcnow

    db = tmp_path / "stale.db"
    with TestClient(make_app(decoder, db, stale_validating_s=600)) as http:
        factory = http.app.state.ctx.session_factory
        now = utcnow()
        with factory.begin() as s:
            for job_id, age in (("job_dead", 601), ("job_young", 60)):
                queries.insert_job(
                    s, id=job_id, target="tiny", drafter="ngram", sampling_defaults={}, n_requests=1,
                    created_at=now - timedelta(seconds=age),
                )  # fmt: skip
                row = {"job_id": job_id, "custom_id": "a", "line_number": 1, "input": "{}", "status": "pending"}
                queries.insert_requests(s, [row])
        batch = run_batch(client_of(http), [completion_line("a", PROMPT)])
        assert batch.status == "completed"
        housekeeping_of(http).tick()
        with factory() as s:
            dead, young = queries.get_job(s, "job_dead"), queries.get_job(s, "job_young")
            assert dead.status == "failed" and "SPEC_BATCH_STALE_VALIDATING_S" in dead.error
            assert dead.failed_at is not None and queries.job_counts(s, "job_dead")["pending"] == 0
            assert young.status == "validating"  # another server may be validating it now
    listed = CliRunner().invoke(main, ["jobs"], env={"SPEC_BATCH_DATABASE_URL": f"sqlite:///{db}"})
    assert listed.exit_code == 0, listed.output
    line_of = {ln.split()[0]: ln for ln in listed.output.splitlines() if ln.strip().startswith("job_")}
    assert "failed" in line_of["job_dead"] and "validating" in line_of["job_young"]
