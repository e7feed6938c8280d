"""Issue 38: a batch that nothing running can run says so. Servers sharing a database run only the batches made
for their own target, drafter, weights and dtype; while none that is running matches, the batch object's `errors`
holds a `no_matching_server` entry (through the official `openai` client), which goes once a matching server runs.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import timedelta

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from spec_batch.server.app import create_app
from spec_batch.server.serve import ServeOptions, build_context
from spec_batch.settings import get_settings
from spec_batch.store import make_session_factory, open_store, queries, servers
from spec_batch.store.models import Job, utcnow

KEY = "sk-servers"
PROMPT = "1 2 3 4 5 1 2 3"


def make_app(decoder, db_path, draft: str):
    base = dataclasses.replace(get_settings(), database_url=f"sqlite:///{db_path}", api_keys=(KEY,))
    factory = open_store(base.database_url, migrate=True)
    return create_app(build_context(base, ServeOptions(target="tiny", draft=draft), factory, decoder=decoder))


def client_of(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def codes(batch) -> list[str]:
    return [e.code for e in batch.errors.data] if batch.errors else []


def test_a_batch_no_running_server_can_run_says_so_until_one_runs_it(tiny_decoder, tmp_path):
    db = tmp_path / "shared.db"
    plain = make_app(tiny_decoder("none"), db, "none")
    body = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": 4}})
    with TestClient(make_app(tiny_decoder("ngram"), db, "ngram")) as ngram_http, TestClient(plain) as plain_http:
        made_by = client_of(plain_http)
        plain_http.app.state.ctx.batches.stop()  # the `--draft none` server stops (its row goes with it)
        f = made_by.files.create(file=("in.jsonl", (body + "\n").encode()), purpose="batch")
        batch = made_by.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while (seen := client_of(ngram_http).batches.retrieve(batch.id)).status == "validating":
            assert time.monotonic() < deadline  # validated after create returned (OpenAI's shape)
            time.sleep(0.1)
        # the other server, ngram, does not run it
        assert seen.status == "in_progress" and codes(seen) == ["no_matching_server"]
        assert "drafter 'none'" in seen.errors.data[0].message
        time.sleep(2.5)  # the ngram runner polls every 2 s: still not its kind
        assert client_of(ngram_http).batches.retrieve(batch.id).status == "in_progress"
        plain_http.app.state.ctx.batches.start()  # a server of its kind runs again: it runs the batch
        deadline = time.monotonic() + 60
        while (batch := made_by.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, batch.status
            assert codes(batch) == [] or batch.status != "in_progress", batch.errors
            time.sleep(0.1)
        assert codes(batch) == []


@pytest.mark.parametrize(
    ("row", "runs"),
    [
        ({}, True),
        ({"drafter": "none"}, False),
        ({"target": "other"}, False),
        ({"weights": "int8"}, False),
        ({"weights": None, "dtype": None}, True),  # a server that does not say runs any
        ({"dtype": "float32"}, False),
        ({"seen": -servers.LIVE_S - 5}, False),  # not seen for too long: dead
    ],
)
def test_which_live_server_runs_a_job(db_url, row, runs):
    factory = make_session_factory(db_url)
    now = utcnow()
    fields = {"target": "tiny", "drafter": "ngram", "weights": "full", "dtype": "bfloat16", "seen": 0, **row}
    seen = now + timedelta(seconds=fields.pop("seen"))
    with factory.begin() as s:
        s.execute(servers.RunningServer.__table__.delete())
        servers.heartbeat(s, "srv", **fields, now=seen)
        queries.insert_job(s, id=f"job_srv_{len(row)}_{runs}", target="tiny", drafter="ngram", sampling_defaults={})
    with factory() as s:
        job = s.get(Job, f"job_srv_{len(row)}_{runs}")
        for weights, dtype in ((None, None), ("full", "bfloat16")):  # NULL weights: full; NULL dtype: any
            job.weights, job.dtype = weights, dtype
            assert servers.can_run(s, job, now) is (runs or (dtype is None and row == {"dtype": "float32"}))
    with factory.begin() as s:
        servers.remove(s, "srv")
        s.execute(Job.__table__.delete().where(Job.id.like("job_srv_%")))
    factory.kw["bind"].dispose()


@pytest.mark.parametrize(
    ("queues", "seen", "served"),
    [
        (["spec-batch.tiny.ngram"], 0, True),
        (["other", "spec-batch.tiny.ngram", "other"], 0, True),  # a queue listed twice: one row
        (["spec-batch.tiny.none"], 0, False),  # another pair's queue
        (["spec-batch.tiny.ngram"], -servers.LIVE_S - 5, False),  # not seen for too long: dead
    ],
)
def test_which_live_worker_serves_a_queue(db_url, queues, seen, served):
    factory = make_session_factory(db_url)
    now = utcnow()
    with factory.begin() as s:
        s.execute(servers.WorkerQueue.__table__.delete())
        servers.worker_heartbeat(s, "host:1:ab", queues, now=now + timedelta(seconds=seen))
    with factory() as s:
        assert servers.queue_served(s, "spec-batch.tiny.ngram", now) is served
        assert len(s.scalars(select(servers.WorkerQueue)).all()) == len(set(queues))
    with factory.begin() as s:
        servers.remove_worker(s, "host:1:ab")
    with factory() as s:
        assert not servers.queue_served(s, "spec-batch.tiny.ngram", now)
    factory.kw["bind"].dispose()
