"""A batch through the queue: the API server (queue runner, no model loaded) publishes it to the Celery queue of the
served pair; a real `spec-batch worker` with the real default model runs it through a private Redis. Until a worker
consumes that queue, the batch object says so (`no_matching_worker`); a worker that stops withdraws its queues."""

from __future__ import annotations

import shutil

import pytest
from batch_testlib import ApiServer, api_env, chat_line, jsonl, wait_batch, write_lines
from sqlalchemy import select

from bench.processes import RedisServer, WorkerProcess, worker_env
from spec_batch.store import make_session_factory, migrate_to_head, queries, servers

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@pytest.fixture
def redis_url(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed: the queue test needs its own Redis")
    server = RedisServer(tmp_path / "redis").start()
    yield server.url
    server.stop()


def test_a_batch_runs_on_the_queue_workers(tmp_path, redis_url):
    db = f"sqlite:///{tmp_path / 'queue.db'}"
    migrate_to_head(db)
    worker = WorkerProcess(
        "w",
        worker_env(db, redis_url, lease_seconds=5, SPEC_BATCH_ADAPTIVE="0", PYTHONPATH=str(ApiServer.repo())),
        tmp_path,
    )
    api = ApiServer(db, tmp_path, api_env(SPEC_BATCH_BROKER_URL=redis_url), "--runner", "queue").start()
    factory = make_session_factory(db)
    try:
        client = api.client(None)
        lines = [chat_line(f"r{i}", f"Name a colour, number {i}.") for i in range(4)] + [
            chat_line("bad", "Hi", top_p=0)
        ]
        f = client.files.create(file=write_lines(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        waiting = wait_batch(client, batch.id, timeout=60, until=("in_progress",))
        assert [e.code for e in waiting.errors.data] == ["no_matching_worker"], waiting.errors
        assert "spec-batch.default.ngram" in waiting.errors.data[0].message
        worker.start().wait_ready()
        done = wait_batch(client, batch.id, timeout=300)
        assert done.status == "completed", worker.log_tail()
        assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
        assert not done.errors or "no_matching_worker" not in [e.code for e in done.errors.data]
        outputs = jsonl(client.files.content(done.output_file_id).text)
        assert [o["custom_id"] for o in outputs] == ["r0", "r1", "r2", "r3"]
        assert [e["custom_id"] for e in jsonl(client.files.content(done.error_file_id).text)] == ["bad"]
        with factory() as s:
            job = queries.get_job(s, batch.id)
            assert job.queue == "spec-batch.default.ngram"
            assert all(r.worker for r in queries.iter_requests(s, batch.id) if r.status == "completed")
            assert {w.queue for w in s.scalars(select(servers.WorkerQueue))} == {"spec-batch.default.ngram"}
        worker.stop()  # SIGTERM: its pool process withdraws its queue
        with factory() as s:
            assert s.scalars(select(servers.WorkerQueue)).all() == [], worker.log_tail()
    finally:
        api.stop()
        worker.stop()
        factory.kw["bind"].dispose()
