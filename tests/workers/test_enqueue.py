"""Submitting and re-enqueueing: the broker checked first, the job committed before anything is published, a
broker lost midway, orphans adopted."""

from __future__ import annotations

import pytest
from batch_lines import completion_line, write_batch
from sqlalchemy import select

from spec_batch.jobs import lifecycle
from spec_batch.store import chunks as qstore
from spec_batch.store import queries
from spec_batch.store.models import Job
from spec_batch.workers import enqueue, reaper
from spec_batch.workers.enqueue import BrokerUnavailableError, PartialEnqueueError, enqueue_job, submit_file
from spec_batch.workers.routing import queue_name

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def test_submit_with_redis_down_creates_no_job(factory, tmp_path, db_url):
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x")])
    with pytest.raises(BrokerUnavailableError, match="cannot reach the broker"):
        submit_file(factory, path, target="default", drafter="ngram", broker_url=DEAD_BROKER)
    with factory() as s:
        assert s.scalars(select(Job)).all() == []


def test_submit_publishes_every_chunk(factory, tmp_path, redis_url):
    import redis

    path = write_batch(
        tmp_path / "b.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(7)] + ['{"custom_id": "bad"}']
    )
    res = submit_file(factory, path, target="default", drafter="ngram", chunk_size=3, broker_url=redis_url)
    assert (res.n_requests, res.n_invalid, res.n_chunks, res.published) == (8, 1, 3, 3)
    r = redis.Redis.from_url(redis_url)
    epoch = r.get(reaper.EPOCH_KEY).decode()
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

    monkeypatch.setattr(enqueue, "publish_chunk", flaky)
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
    job_id, _ = create_job_from_file(
        factory, path, target="default", drafter="ngram", queue=queue_name("default", "ngram"), chunk_size=2
    )
    with factory() as s:
        assert len(qstore.orphan_request_ids(s, job_id)) == 5
    sent = []
    monkeypatch.setattr(enqueue, "publish_chunk", lambda cid, q, broker_url=None: sent.append(cid))
    rep = enqueue_job(factory, job_id, broker_url=redis_url)
    assert rep.new_chunks == 3 and len(sent) == 3
    with factory() as s:
        assert qstore.orphan_request_ids(s, job_id) == []
    rep = enqueue_job(factory, job_id, broker_url=redis_url)  # again: nothing new, queued ones republished
    assert rep.new_chunks == 0 and rep.republished == 3


def _validating_queue_job(factory, tmp_path, monkeypatch, n: int) -> str:
    """A queue job whose submit stored its rows and died before starting it: validating, requests pending."""
    from spec_batch.jobs import create_job_from_file

    path = write_batch(tmp_path / "v.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(n)])
    with monkeypatch.context() as m:
        m.setattr(lifecycle, "start", lambda *args, **kwargs: False)  # the process died before this
        job_id, _ = create_job_from_file(
            factory, path, target="default", drafter="ngram", queue=queue_name("default", "ngram"), chunk_size=2
        )
    return job_id


def test_enqueue_job_starts_a_job_left_validating(factory, tmp_path, redis_url, monkeypatch):
    job_id = _validating_queue_job(factory, tmp_path, monkeypatch, 3)
    with factory() as s:
        assert queries.get_job(s, job_id).status == "validating"
    sent = []
    monkeypatch.setattr(enqueue, "publish_chunk", lambda cid, q, broker_url=None: sent.append(cid))
    rep = enqueue_job(factory, job_id, broker_url=redis_url)
    assert (rep.status, rep.new_chunks, len(sent)) == ("in_progress", 2, 2)
    with factory() as s:
        assert queries.get_job(s, job_id).status == "in_progress"


def test_enqueue_job_reports_the_status_a_racing_change_left(factory, tmp_path, redis_url, monkeypatch):
    """start() is a conditional UPDATE: when the job left validating meanwhile (here a cancel that won the race),
    it returns False, and enqueue reports the status the job has and gives it no chunks."""
    job_id = _validating_queue_job(factory, tmp_path, monkeypatch, 3)
    start = lifecycle.start

    def cancelled_first(session, job_id, **kwargs):
        assert lifecycle.request_cancel(session, job_id)
        return start(session, job_id, **kwargs)

    monkeypatch.setattr(lifecycle, "start", cancelled_first)
    sent = []
    monkeypatch.setattr(enqueue, "publish_chunk", lambda cid, q, broker_url=None: sent.append(cid))
    rep = enqueue_job(factory, job_id, broker_url=redis_url)
    assert (rep.status, rep.new_chunks, sent) == ("cancelling", 0, [])
    with factory() as s:
        assert queries.get_job(s, job_id).status == "cancelling"
        assert qstore.job_chunks(s, job_id) == []
