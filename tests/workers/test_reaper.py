"""Leases, the heartbeat and the reaper: expired chunks re-queued then split then given up, dead siblings taken
over at once, lost messages republished, unfinished jobs finalized, orphans adopted."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

from batch_lines import completion_line, write_batch
from sqlalchemy import select, update

from spec_batch.jobs import lease, lifecycle
from spec_batch.jobs.lease import holder_prefix
from spec_batch.store import chunk_recovery, queries, request_claims
from spec_batch.store import chunks as qstore
from spec_batch.store.models import Job, Request, utcnow
from spec_batch.workers import reaper, tasks
from spec_batch.workers.routing import queue_name

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


class Published(list):
    def __call__(self, chunk):
        self.append((chunk.id, chunk.queue))


def _reap(factory, published, *, lease_seconds=5, max_attempts=3, epoch="e1", monkeypatch=None):
    monkeypatch.setattr(reaper, "broker_epoch", lambda url: epoch)
    from spec_batch.jobs.lifecycle import finalize_job

    return reaper.reap(
        factory,
        broker_url="redis://unused",
        publish=published,
        lease_seconds=lease_seconds,
        max_attempts=max_attempts,
        finalize=lambda j: finalize_job(factory, j),
    )


def _hold(factory, chunk, token, *, expired=True, claim_requests=True):
    with factory.begin() as s:
        assert qstore.claim_chunk(s, chunk.id, token, 30)
        if claim_requests:
            request_claims.claim_requests(s, chunk.job_id, chunk.request_ids, worker=token, lease_seconds=30)
        if expired:
            past = utcnow() - timedelta(seconds=1)
            s.execute(update(qstore.QueueChunk).where(qstore.QueueChunk.id == chunk.id).values(lease_expires_at=past))
            s.execute(update(Request).where(Request.worker == token).values(lease_expires_at=past))


def test_heartbeat_renews_leases(factory, queued_job):
    _, chunks = queued_job(n=2, chunk_size=2)
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
        assert chunk_recovery.expired_chunks(s) == []
    assert not holding.lost


def test_a_redelivered_message_takes_over_an_expired_chunk(factory, queued_job, fake_runtime, job_state):
    """Redis redelivered the message of a vanished worker before any reaper ran: the task takes the chunk
    and the old holder's requests at once, even those whose lease was renewed a moment after the chunk's."""
    job_id, chunks = queued_job(n=3, chunk_size=3)
    _hold(factory, chunks[0], "gone/n/1/a", expired=True)
    with factory.begin() as s:
        s.execute(
            update(Request)
            .where(Request.worker == "gone/n/1/a")
            .values(lease_expires_at=utcnow() + timedelta(seconds=30))
        )
    out = tasks._process(fake_runtime(), chunks[0].id, lease.new_token())
    assert out["completed"] == 3 and out["finalized"]
    counts, job = job_state(job_id)
    assert counts["completed"] == 3 and job.status == "completed"


def test_reaper_requeues_an_expired_chunk_then_splits_then_gives_up(factory, monkeypatch, queued_job, job_state):
    job_id, chunks = queued_job(n=3, chunk_size=3)
    chunk = chunks[0]
    pub = Published()
    # live lease: nothing to do
    _hold(factory, chunk, "lost/n/1/a", expired=False)
    assert not _reap(factory, pub, monkeypatch=monkeypatch).any() and pub == []
    # first loss: the same chunk again, its requests pending at once
    with factory.begin() as s:
        s.execute(
            update(qstore.QueueChunk)
            .where(qstore.QueueChunk.id == chunk.id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
    rep = _reap(factory, pub, monkeypatch=monkeypatch)
    assert rep.requeued == 1 and pub == [(chunk.id, chunk.queue)]
    counts, _ = job_state(job_id)
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
    counts, job = job_state(job_id)
    assert counts["failed"] == 3 and job.status == "completed"
    with factory() as s:
        errs = s.scalars(select(Request.error_code).where(Request.job_id == job_id)).all()
    assert set(errs) == {"worker_lost"}


def test_reaper_takes_over_a_dead_sibling_at_once(factory, monkeypatch, queued_job):
    """A killed pool child of this worker node: no need to wait for its lease."""
    _, chunks = queued_job(n=2, chunk_size=2)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    token = f"{holder_prefix()}{proc.pid}/dead"
    _hold(factory, chunks[0], token, expired=False)
    pub = Published()
    rep = _reap(factory, pub, monkeypatch=monkeypatch)
    assert rep.requeued == 1 and pub == [(chunks[0].id, chunks[0].queue)]


def test_reaper_republishes_after_the_broker_lost_its_messages(factory, monkeypatch, queued_job):
    job_id, chunks = queued_job(n=4, chunk_size=2)  # published in epoch e1
    pub = Published()
    assert not _reap(factory, pub, epoch="e1", monkeypatch=monkeypatch).any()
    rep = _reap(factory, pub, epoch="e2", monkeypatch=monkeypatch)  # Redis restarted: a new epoch
    assert rep.republished == 2 and sorted(pub) == sorted((c.id, c.queue) for c in chunks)
    assert not _reap(factory, pub, epoch="e2", monkeypatch=monkeypatch).any()
    with factory() as s:
        assert {c.epoch for c in qstore.job_chunks(s, job_id)} == {"e2"}


def test_reaper_publishes_chunks_a_submit_never_published(factory, monkeypatch, queued_job):
    _, _chunks = queued_job(n=2, chunk_size=2)
    with factory.begin() as s:
        s.execute(update(qstore.QueueChunk).values(epoch=None))
    pub = Published()
    assert not _reap(factory, pub, monkeypatch=monkeypatch, lease_seconds=60).any()  # a submit may be at it
    with factory.begin() as s:
        s.execute(update(qstore.QueueChunk).values(created_at=utcnow() - timedelta(seconds=120)))
    assert _reap(factory, pub, monkeypatch=monkeypatch, lease_seconds=60).republished == 1


def test_reaper_finishes_jobs_whose_last_worker_died(factory, monkeypatch, queued_job, fake_runtime):
    job_id, chunks = queued_job(n=2, chunk_size=2)
    tasks._process(fake_runtime(), chunks[0].id, lease.new_token())
    # pretend the worker died after storing the results, before finalizing
    with factory.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(status="in_progress", completed_at=None))
    assert _reap(factory, Published(), monkeypatch=monkeypatch).finalized == 1
    with factory() as s:
        assert queries.get_job(s, job_id).status == "completed"
    # ... or between finalizing and completing
    with factory.begin() as s:
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status="finalizing", finalizing_at=utcnow() - timedelta(seconds=60))
        )
    assert _reap(factory, Published(), monkeypatch=monkeypatch).finalized == 1
    with factory() as s:
        assert queries.get_job(s, job_id).status == "completed"


def test_reaper_with_the_broker_down_does_nothing(factory, queued_job):
    queued_job(n=2, chunk_size=2)
    rep = reaper.reap(
        factory, broker_url=DEAD_BROKER, publish=Published(), lease_seconds=5, max_attempts=3, finalize=lambda j: None
    )
    assert rep.errors and not rep.any()


def test_reaper_cancels_a_dead_workers_chunk_of_a_cancelling_job(factory, monkeypatch, queued_job, job_state):
    job_id, chunks = queued_job(n=2, chunk_size=2)
    _hold(factory, chunks[0], "lost/n/1/a")
    with factory.begin() as s:
        lifecycle.request_cancel(s, job_id)
    pub = Published()
    _reap(factory, pub, monkeypatch=monkeypatch)
    counts, job = job_state(job_id)
    assert pub == [] and job.status == "cancelled" and counts["cancelled"] == 2


def test_reaper_adopts_orphans_after_a_grace(factory, tmp_path):
    from spec_batch.jobs import create_job_from_file

    path = write_batch(tmp_path / "b.jsonl", [completion_line(f"r{i}", f"p{i}") for i in range(3)])
    job_id, _ = create_job_from_file(
        factory, path, target="default", drafter="ngram", queue=queue_name("default", "ngram"), chunk_size=2
    )
    pub = Published()
    assert reaper.adopt_orphans(factory, grace_s=60, publish=pub, epoch="e", chunk_size=2) == 0
    with factory.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(created_at=utcnow() - timedelta(seconds=120)))
    assert reaper.adopt_orphans(factory, grace_s=60, publish=pub, epoch="e", chunk_size=2) == 2 and len(pub) == 2
