"""The chunk task in-process with a fake runtime: store once, complete once, skip what others hold, fail alone,
cancel and take-over. The same with real worker processes: test_queue_workers.py."""

from __future__ import annotations

from batch_lines import completion_line
from sqlalchemy import select, update

from spec_batch.jobs import cancel_job, lease, lifecycle, runner
from spec_batch.store import chunks as qstore
from spec_batch.store.models import Request
from spec_batch.workers import tasks


def test_chunks_run_store_once_and_complete_the_job_once(factory, queued_job, fake_runtime, job_state):
    job_id, chunks = queued_job(n=5, chunk_size=2, baseline=2)
    rt = fake_runtime()
    outs = [tasks._process(rt, c.id, lease.new_token()) for c in chunks]
    assert [o.get("finalized") for o in outs] == [False, False, True]
    counts, job = job_state(job_id)
    assert counts["completed"] == 5 and job.status == "completed" and job.baseline_wall_s is not None
    # redelivered messages do nothing
    again = tasks._process(rt, chunks[0].id, lease.new_token())
    assert again["skipped"] == "chunk done"
    with factory() as s:
        assert {c.state for c in qstore.job_chunks(s, job_id)} == {"done"}
        rows = s.scalars(select(Request).where(Request.job_id == job_id)).all()
        assert all(r.output and r.completed_at and r.lease_expires_at is None for r in rows)
    assert rt.loads == 3  # the fake runtime counts calls; the real one caches (see test_queue_workers)


def test_a_chunk_held_by_a_live_worker_is_skipped(factory, queued_job, fake_runtime, job_state):
    job_id, chunks = queued_job(n=2, chunk_size=2)
    with factory.begin() as s:
        assert qstore.claim_chunk(s, chunks[0].id, "elsewhere/node/1/abc", 30)
    out = tasks._process(fake_runtime(), chunks[0].id, lease.new_token())
    assert out["skipped"].startswith("held by elsewhere/")
    counts, _ = job_state(job_id)
    assert counts["pending"] == 2


def test_an_unknown_chunk_id_is_a_no_op(factory, fake_runtime):
    assert tasks._process(fake_runtime(), "no-such-chunk", lease.new_token())["skipped"] == "unknown chunk"


def test_a_failing_request_fails_alone(factory, queued_job, fake_runtime, job_state):
    lines = [
        completion_line("ok1", "fine"),
        completion_line("bad", "TOO LONG here"),
        completion_line("ok2", "also fine"),
    ]
    job_id, chunks = queued_job(lines=lines, chunk_size=3)
    tasks._process(fake_runtime(), chunks[0].id, lease.new_token())
    counts, job = job_state(job_id)
    assert counts["completed"] == 2 and counts["failed"] == 1 and job.status == "completed"
    with factory() as s:
        bad = s.scalar(select(Request).where(Request.job_id == job_id, Request.custom_id == "bad"))
        assert bad.status == "failed" and bad.error and bad.error_code == "decode_error"


def test_an_unknown_model_fails_the_chunk_without_retry(factory, queued_job, fake_runtime, job_state):
    from spec_batch.errors import UnknownModelError

    def unknown(target, drafter):
        raise UnknownModelError(f"model {target!r} is not recognised")

    job_id, chunks = queued_job(n=2, chunk_size=2)
    rt = fake_runtime()
    rt.decoder = unknown
    out = tasks._process(rt, chunks[0].id, lease.new_token())
    assert out["failed"] == "model_error"
    counts, job = job_state(job_id)
    assert counts["failed"] == 2 and job.status == "completed"


def test_a_chunk_of_a_job_cancelled_before_it_started_does_nothing(factory, queued_job, fake_runtime, job_state):
    job_id, chunks = queued_job(n=4, chunk_size=2)
    assert cancel_job(factory, job_id).status == "cancelled"
    out = tasks._process(fake_runtime(), chunks[0].id, lease.new_token())
    assert "skipped" in out
    counts, job = job_state(job_id)
    assert job.status == "cancelled" and counts["cancelled"] == 4 and counts["completed"] == 0


def test_cancel_while_running_stops_between_batches(
    factory, monkeypatch, queued_job, fake_runtime, job_state, fake_decoder_cls
):
    monkeypatch.setattr(runner, "CANCEL_CHECK_S", 0.0)
    job_id, chunks = queued_job(n=6, chunk_size=6, batch_size=2)

    class CancellingDecoder(fake_decoder_cls):
        def generate(self, prompts, params, batch_size=8, *, on_result=None, **kw):
            def cb(i, res):
                on_result(i, res)
                if i == 1:  # the first decoding batch of 2 is done: the user cancels
                    with factory.begin() as s:
                        lifecycle.request_cancel(s, job_id)

            return super().generate(prompts, params, batch_size, on_result=cb, **kw)

    out = tasks._process(fake_runtime(CancellingDecoder()), chunks[0].id, lease.new_token())
    assert out["stopped"] == "cancelled"
    counts, job = job_state(job_id)
    assert job.status == "cancelled"
    # the two results stored before the cancel are kept; the decoder stopped at its next step, and the rows it
    # had not finished were given back, then cancelled with the job (none stored as a result)
    assert counts["completed"] == 2 and counts["cancelled"] == 4 and counts["running"] == counts["pending"] == 0


def test_a_chunk_taken_over_stops_its_old_holder(factory, queued_job, fake_runtime, job_state, fake_decoder_cls):
    job_id, chunks = queued_job(n=4, chunk_size=4, batch_size=1)
    rt = fake_runtime()

    class StolenDecoder(fake_decoder_cls):
        def generate(self, prompts, params, batch_size=8, *, on_result=None, **kw):
            def cb(i, res):
                on_result(i, res)
                if i == 0:  # meanwhile a reaper gave the chunk to another worker
                    with factory.begin() as s:
                        s.execute(
                            update(qstore.QueueChunk)
                            .where(qstore.QueueChunk.id == chunks[0].id)
                            .values(worker="other/n/1/x")
                        )
                    rt.heartbeat.tick()

            return super().generate(prompts, params, batch_size, on_result=cb, **kw)

    rt._decoder = StolenDecoder()
    out = tasks._process(rt, chunks[0].id, lease.new_token())
    assert out["stopped"] == "taken over"
    counts, _ = job_state(job_id)
    # it stopped at its next decoding step: one result kept, the rest given back for the new holder
    assert counts["completed"] == 1 and counts["pending"] == 3
