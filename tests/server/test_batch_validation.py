"""POST /v1/batches answers `validating` at once and the file is validated afterwards (issue 38, low 1; OpenAI's
shape), through the official `openai` client on the app in process (the lifespan runs the engine, the batch runner,
the validator and the housekeeping) over the tiny random model and SQLite:

- a file whose validation is slow (a held validator) comes back from create `validating`, with no request rows yet,
  then runs to `completed`; a bad line ends the batch `failed` with the line named in `errors`;
- a batch cancelled while validating ends `cancelled` and its validation, once done, writes nothing;
- a server killed mid-validation: a restarted server validates again its kind's batches left `validating` that are
  younger than SPEC_BATCH_STALE_VALIDATING_S; older ones are failed by the housekeeping's sweep, and another kind's
  are left alone.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from datetime import timedelta

import openai
import pytest
from fastapi.testclient import TestClient

from spec_batch.server import batch_create
from spec_batch.server.app import create_app
from spec_batch.server.auth import owner_hash
from spec_batch.server.housekeeping import Housekeeping
from spec_batch.server.serve import ServeOptions, build_context
from spec_batch.settings import get_settings
from spec_batch.store import open_store, queries
from spec_batch.store.models import utcnow

KEY = "sk-validation"
PROMPT = "1 2 3 4 5 1 2 3"
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder("ngram")


def make_ctx(decoder, db_path, **settings):
    base = dataclasses.replace(get_settings(), database_url=f"sqlite:///{db_path}", api_keys=(KEY,), **settings)
    factory = open_store(base.database_url, migrate=True)
    return build_context(base, ServeOptions(target="tiny", draft="ngram"), factory, decoder=decoder)


def client_of(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def line(cid: str, prompt: str = PROMPT) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def upload(client, lines: list[str]):
    return client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")


def wait(client, batch_id: str, until=ENDED, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.1)
    return batch


@pytest.fixture
def held(monkeypatch):
    """Validation waits until the test sets the event (a file that takes long to validate)."""
    gate = threading.Event()
    parse = batch_create.parse_stored

    def slow(*args, **kwargs):
        assert gate.wait(60), "the test never let validation go on"
        return parse(*args, **kwargs)

    monkeypatch.setattr(batch_create, "parse_stored", slow)
    yield gate
    gate.set()


def test_create_returns_validating_then_the_batch_runs(decoder, tmp_path, held):
    with TestClient(create_app(make_ctx(decoder, tmp_path / "v.db"))) as http:
        client = client_of(http)
        f = upload(client, [line(f"r{i}") for i in range(20)])
        made = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert made.status == "validating" and made.request_counts.total == 0 and made.in_progress_at is None
        time.sleep(0.3)
        seen = client.batches.retrieve(made.id)  # still validating: no request row written yet
        assert seen.status == "validating" and seen.request_counts.total == 0
        assert [b.status for b in client.batches.list().data] == ["validating"]
        held.set()
        done = wait(client, made.id)
        assert done.status == "completed" and done.request_counts.total == done.request_counts.completed == 20
        assert done.in_progress_at is not None and done.errors is None


def test_a_bad_line_fails_the_batch_after_create_naming_the_line(decoder, tmp_path, held):
    with TestClient(create_app(make_ctx(decoder, tmp_path / "bad.db"))) as http:
        client = client_of(http)
        f = upload(client, [line("a"), "{not json", line("c")])
        made = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert made.status == "validating"
        held.set()
        failed = wait(client, made.id)
        assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
        assert [(e.line, e.code) for e in failed.errors.data] == [(2, "invalid_json")]
        assert "line 2" in failed.errors.data[0].message and failed.request_counts.total == 0


def test_a_batch_cancelled_while_validating_writes_nothing(decoder, tmp_path, held):
    ctx = make_ctx(decoder, tmp_path / "cancel.db")
    with TestClient(create_app(ctx)) as http:
        client = client_of(http)
        f = upload(client, [line("a"), line("b")])
        made = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert client.batches.cancel(made.id).status in ("cancelling", "cancelled")
        assert wait(client, made.id).status == "cancelled"
        held.set()
        ctx.validator.stop()  # returns once the validation in flight (the cancelled batch's) is done
        batch = client.batches.retrieve(made.id)
        assert batch.status == "cancelled" and batch.request_counts.total == 0
        with ctx.session_factory() as s:
            assert sum(queries.job_counts(s, made.id).values()) == 0  # no request row was written


def _left_validating(ctx, f_id: str, age_s: float, monkeypatch, **fields) -> str:
    """What a server killed mid-validation leaves: the job and its batch row, validating, no request rows."""
    monkeypatch.setattr(batch_create, "utcnow", lambda: utcnow() - timedelta(seconds=age_s))
    own = dataclasses.replace(ctx.batches.job_fields(), **fields)
    batch_id = batch_create.open_batch(
        ctx.session_factory,
        input_file_id=f_id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata=None,
        owner=owner_hash(KEY),
        fields=own,
    )
    monkeypatch.undo()
    return batch_id


def test_a_restarted_server_validates_its_young_batches_and_the_sweep_fails_old_ones(decoder, tmp_path, monkeypatch):
    db = tmp_path / "restart.db"
    with TestClient(create_app(make_ctx(decoder, db))) as http:  # the first server: it stores the file
        f = upload(client_of(http), [line("a"), line("b")])
    ctx = make_ctx(decoder, db, stale_validating_s=600)
    young = _left_validating(ctx, f.id, 60, monkeypatch)
    old = _left_validating(ctx, f.id, 601, monkeypatch)
    other = _left_validating(ctx, f.id, 60, monkeypatch, drafter="none")  # another kind's server made it
    with TestClient(create_app(ctx)) as http:  # the restarted server
        client = client_of(http)
        next(s for s in ctx.services if isinstance(s, Housekeeping)).tick()
        done = wait(client, young)
        assert done.status == "completed" and done.request_counts.completed == 2
        swept = client.batches.retrieve(old)
        assert swept.status == "failed"
        with ctx.session_factory() as s:
            assert "SPEC_BATCH_STALE_VALIDATING_S" in queries.get_job(s, old).error
            assert queries.get_job(s, other).status == "validating"  # left to a server of its kind, or the sweep
