"""Fixtures of the worker tests: brokers, and a store with queue jobs for the task run without Celery.

- ``redis_url`` (session): a private ``redis-server``'s db 0 when the binary is installed, else the shared
  server's db 15 (``SPEC_BATCH_TEST_REDIS_URL``), flushed; skipped with the reason when neither is reachable.
- ``redis_server``: a private, restartable Redis for one test.
- ``factory``: a session factory on an empty store (SQLite and PostgreSQL, through ``db_url``).
- ``queued_job(n, chunk_size, ...)``: a queue job and its chunks; ``job_state(job_id)``: its counts and row.
- ``fake_runtime(decoder=None, ...)``: what the task needs from a worker process (``FakeRuntime``).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from batch_lines import completion_line, write_batch
from queue_testlib import SHARED_REDIS_URL, RedisServer, redis_ping


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """A clean broker URL for the queue tests (see the module docstring)."""
    if shutil.which("redis-server"):
        server = RedisServer(tmp_path_factory.mktemp("redis")).start()
        yield server.url
        server.stop()
        return
    if not redis_ping(SHARED_REDIS_URL):
        pytest.skip(
            f"no redis-server binary and Redis at {SHARED_REDIS_URL} cannot be reached "
            f"(start it with scripts/services.sh)"
        )
    import redis

    redis.Redis.from_url(SHARED_REDIS_URL).flushdb()
    yield SHARED_REDIS_URL


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    """A private Redis for one test (restartable); skipped when redis-server is not installed."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed: the Redis restart test needs its own server")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


# ---------------------------------------------------------------- a store and the task without Celery


class FakeRuntime:
    """What the task needs from a worker process, without Celery: a store, a decoder, a heartbeat (not started:
    tests tick it). `loads` counts decoder() calls."""

    def __init__(self, factory, decoder, lease_seconds: int = 30, max_attempts: int = 3):
        from spec_batch.jobs import lease
        from spec_batch.settings import get_settings

        self.session_factory = factory
        self.settings = dataclasses.replace(get_settings(), lease_seconds=lease_seconds, max_attempts=max_attempts)
        self.heartbeat = lease.Heartbeat(factory, lease_seconds=lease_seconds)
        self._decoder = decoder
        self.loads = 0
        from spec_batch.jobs.job_memory_store import JobMemories

        self.memories = JobMemories(self.settings.suffix_memory_jobs, self.settings.suffix_memory_tokens)

    def decoder(self, target, drafter):
        self.loads += 1
        return self._decoder


@pytest.fixture
def factory(db_url):
    """A session factory on an empty store (the PostgreSQL database is shared by the session's tests; the
    reaper looks at every job)."""
    from sqlalchemy import delete

    from spec_batch.store import Job, make_session_factory

    f = make_session_factory(db_url)
    with f.begin() as s:
        s.execute(delete(Job))
    yield f
    f.kw["bind"].dispose()


@pytest.fixture
def fake_runtime(factory, fake_decoder_cls):
    """fake_runtime(decoder=None, lease_seconds=30, max_attempts=3): a FakeRuntime on `factory`."""

    def make(decoder=None, **kw) -> FakeRuntime:
        return FakeRuntime(factory, decoder if decoder is not None else fake_decoder_cls(), **kw)

    return make


@pytest.fixture
def queued_job(factory, tmp_path):
    """queued_job(n=5, chunk_size=2, lines=None, baseline=0, batch_size=2) -> (job_id, chunks): a queue job
    of n completion requests, its chunks stored as published in epoch "e1" (nothing is sent to a broker)."""
    from spec_batch.jobs import create_job_from_file
    from spec_batch.store import chunks as qstore
    from spec_batch.store import queries
    from spec_batch.workers.routing import queue_name

    def make(n: int = 5, chunk_size: int = 2, *, lines=None, baseline: int = 0, batch_size: int = 2):
        lines = lines or [completion_line(f"r{i}", f"prompt number {i}") for i in range(n)]
        path = write_batch(tmp_path / f"batch{len(list(tmp_path.glob('batch*')))}.jsonl", lines)
        q = queue_name("fake", "ngram")
        job_id, _ = create_job_from_file(
            factory,
            path,
            target="fake",
            drafter="ngram",
            batch_size=batch_size,
            baseline_sample=baseline,
            queue=q,
            chunk_size=chunk_size,
        )
        with factory.begin() as s:
            ids = queries.open_request_ids(s, job_id)
            chunks = qstore.add_chunks(s, job_id, q, ids, chunk_size, measure_baseline=baseline > 0, epoch="e1")
        return job_id, chunks

    return make


@pytest.fixture
def job_state(factory):
    """job_state(job_id) -> ({request status: count}, Job)."""
    from spec_batch.store import queries

    def read(job_id):
        with factory() as s:
            return queries.job_counts(s, job_id), queries.get_job(s, job_id)

    return read
