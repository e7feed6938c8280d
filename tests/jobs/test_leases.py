"""In-process runs hold their claims like workers: a lease renewed by a heartbeat, never taken over while its
holder lives; resume says who holds a job instead of decoding its requests a second time."""

from __future__ import annotations

import os
import threading
import time

import pytest
from batch_lines import completion_line, write_batch

from spec_batch.jobs import JobBusyError, create_job_from_file, resume, resume_job, run_job
from spec_batch.jobs.lease import HOST, holder_is_dead, new_token
from spec_batch.store import chunks as qstore
from spec_batch.store import make_session_factory, queries, request_claims
from spec_batch.store.models import utcnow


def _job(factory, tmp_path, n: int, max_tokens: int = 6, **kw) -> str:
    path = write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", f"p{i}", max_tokens=max_tokens) for i in range(n)]
    )
    job_id, _ = create_job_from_file(factory, path, target="fake-target", drafter="ngram", baseline_sample=0, **kw)
    return job_id


def _running(factory, job_id):
    with factory() as s:
        return [(token, n, until) for token, n, until in request_claims.request_holders(s, job_id)]


def test_a_live_run_keeps_its_leases_and_a_resume_leaves_it_alone(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, 4, max_tokens=30, batch_size=4)  # 10 steps each: 2 s in all
    lease_s = 0.15
    run = threading.Thread(
        target=run_job, args=(factory, job_id, fake_decoder_cls(step_delay=0.05)), kwargs={"lease_seconds": lease_s}
    )
    run.start()
    try:
        deadline = time.monotonic() + 10
        while not _running(factory, job_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(3 * lease_s)  # longer than the lease: only the heartbeat keeps the claims
        holders = _running(factory, job_id)
        assert holders and all(until > utcnow() for _, _, until in holders)
        second = fake_decoder_cls()
        with pytest.raises(JobBusyError, match=f"process {os.getpid()} on {HOST}"):
            resume_job(factory, job_id, second)
        assert second.generate_calls == []
    finally:
        run.join()
    with factory() as s:
        assert queries.get_job(s, job_id).status == "completed"
    assert {r for r in _attempts(factory, job_id)} == {0}  # every request decoded once, no claim lost


def _attempts(factory, job_id):
    from sqlalchemy import select

    from spec_batch.store import Request

    with factory() as s:
        return s.scalars(select(Request.attempts).where(Request.job_id == job_id)).all()


def test_a_token_names_a_process_and_only_a_gone_one_is_dead():
    token = new_token()
    assert token.startswith(f"{HOST}/") and f"/{os.getpid()}/" in token
    assert not holder_is_dead(token)  # this process
    assert not holder_is_dead("another-host/ns1/1/x") and not holder_is_dead("dead:1")  # unknown: its lease decides


def test_resuming_a_queued_job_leaves_running_chunks_to_their_workers(db_url, tmp_path):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, 2, queue="spec-batch.fake.ngram", chunk_size=1)
    with factory.begin() as s:
        chunks = qstore.add_chunks(s, job_id, "spec-batch.fake.ngram", queries.request_ids(s, job_id), 1, epoch="e")
        assert qstore.claim_chunk(s, chunks[0].id, "worker-host/ns1/9/a", 600)
        request_claims.claim_requests(s, job_id, chunks[0].request_ids, worker="worker-host/ns1/9/a", lease_seconds=600)
    enqueued = []
    outcome = resume(
        factory,
        job_id,
        decoder_for=lambda t, d: pytest.fail("a queued job is not decoded here"),
        enqueue=lambda f, j: enqueued.append(j) or "report",
    )
    assert outcome.action == "enqueued" and enqueued == [job_id] and outcome.running == 1
    with factory() as s:
        assert queries.job_counts(s, job_id)["running"] == 1  # the worker's request untouched
