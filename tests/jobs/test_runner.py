"""The runner and the job service: a full job, idempotent re-runs, interruption and resume, overlapping
runners, cancellation, the measured baseline. Fast tests use the fake decoder; the full job uses the real model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from batch_lines import chat_line, completion_line, write_batch
from sqlalchemy import select, update

from spec_batch.jobs import (
    JobBusyError,
    create_job_from_file,
    lifecycle,
    measure_baseline,
    resume_job,
    run_job,
    write_results,
)
from spec_batch.jobs.baseline import WARMUP_TOKENS
from spec_batch.jobs.batch_output import errors_path_for, iter_jsonl
from spec_batch.jobs.errors import RunStopped
from spec_batch.jobs.lease import holder_prefix
from spec_batch.jobs.lifecycle import finalize_job
from spec_batch.jobs.runner import run_requests
from spec_batch.store import Job, Request, make_session_factory, queries, request_claims, summaries
from spec_batch.store.models import utcnow


def _rows(factory, job_id):
    with factory() as s:
        return s.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.line_number)).all()


def _snapshot(factory, job_id):
    cols = ("id", "status", "output", "finish_reason", "error_code", "output_tokens", "attempts", "completed_at")
    return [tuple(getattr(r, c) for c in cols) for r in _rows(factory, job_id)]


def _job(factory, job_id) -> Job:
    with factory() as s:
        return queries.get_job(s, job_id)


def _make_job(factory, tmp_path, n=10, *, bad=True, max_tokens=4, **kw):
    lines = [completion_line(f"c{i}", f"prompt number {i}", max_tokens=max_tokens) for i in range(n)]
    if bad:
        lines += [
            "{not json",
            chat_line("tmpl", "BAD TEMPLATE please"),  # valid line; the chat template rejects it
            completion_line("long", "TOO LONG for the context"),  # valid line; decoding fails
            completion_line("c0", "duplicate"),
            json.dumps({"custom_id": "x", "url": "/v1/embeddings", "body": {}}),
        ]
    path = write_batch(tmp_path / "in.jsonl", lines)
    kw.setdefault("baseline_sample", 0)
    return create_job_from_file(
        factory, path, target="fake-target", drafter="ngram", output_file=tmp_path / "out" / "res.jsonl", **kw
    )


def test_full_job_with_fake_decoder(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, parsed = _make_job(factory, tmp_path, n=10, batch_size=3, baseline_sample=2)
    assert len(parsed.requests) == 12 and len(parsed.errors) == 3
    assert _job(factory, job_id).status == "in_progress"
    progress = []
    report = run_job(factory, job_id, fake_decoder_cls(), on_progress=lambda r: progress.append(r.done))
    assert report.finalized and report.stopped is None
    rows = _rows(factory, job_id)
    by_cid = {r.custom_id: r for r in rows if r.custom_id and r.endpoint}  # valid rows (invalid ones keep theirs too)
    assert all(by_cid[f"c{i}"].status == "completed" for i in range(10))
    assert by_cid["c3"].output == fake_decoder_cls.REPLY[:4] and by_cid["c3"].worker  # max_tokens 4
    assert (by_cid["tmpl"].status, by_cid["tmpl"].error_code) == ("failed", "chat_template_error")
    assert by_cid["long"].status == "failed" and "does not fit" in by_cid["long"].error
    invalid = [r for r in rows if r.endpoint is None]
    assert [(r.line_number, r.error_code) for r in invalid] == [
        (11, "invalid_json"),
        (14, "duplicate_custom_id"),
        (15, "unsupported_endpoint"),
    ]
    job = _job(factory, job_id)
    assert job.status == "completed" and job.completed_at >= job.created_at and job.baseline_requests == 2
    assert job.n_requests == 15 and job.n_invalid == 3
    # output files: results in input order, every failure with its line number
    out = list(iter_jsonl(tmp_path / "out" / "res.jsonl"))
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(10)]
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == by_cid["c0"].output_tokens
    errs = list(iter_jsonl(errors_path_for(tmp_path / "out" / "res.jsonl")))
    lines = [e["error"]["line"] if e["error"] else e["response"]["body"]["error"]["line"] for e in errs]
    assert lines == [11, 12, 13, 14, 15]
    with factory() as s:
        row = summaries.job_summary_row(s, job_id)
    assert (row["n_requests"], row["n_completed"], row["n_failed"]) == (15, 10, 5)
    assert row["output_tokens"] == sum(r.output_tokens or 0 for r in rows)
    assert row["speedup"] is not None and row["tokens_per_s"] is not None
    assert progress and progress[-1] == report.done


def test_rerun_is_idempotent(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=6)
    run_job(factory, job_id, fake_decoder_cls())
    before = _snapshot(factory, job_id)
    decode_s = _job(factory, job_id).decode_wall_s
    dec = fake_decoder_cls()
    with factory() as s:
        all_ids = queries.request_ids(s, job_id)
    again = run_requests(factory, job_id, dec, request_ids=all_ids + all_ids[:3])
    assert (again.claimed, again.completed, again.failed) == (0, 0, 0) and not again.finalized
    assert dec.generate_calls == []
    run_job(factory, job_id, dec)
    assert _snapshot(factory, job_id) == before and _job(factory, job_id).decode_wall_s == decode_s
    assert finalize_job(factory, job_id) is False


def test_interrupt_hands_requests_back_and_resume_loses_nothing(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=8, bad=False, batch_size=8)
    with pytest.raises(KeyboardInterrupt):
        run_job(factory, job_id, fake_decoder_cls(interrupt_after=3))
    rows = _rows(factory, job_id)
    assert [r.status for r in rows].count("completed") == 3
    assert [r.status for r in rows].count("pending") == 5  # claimed but unfinished: back to pending at once
    done_before = {r.id: (r.output, r.completed_at) for r in rows if r.status == "completed"}
    dec = fake_decoder_cls()
    report = resume_job(factory, job_id, dec)
    assert report.completed == 5 and report.finalized
    assert sum(len(prompts) for prompts, _ in dec.generate_calls) == 5  # only the unfinished ones were decoded
    rows = _rows(factory, job_id)
    assert all(r.status == "completed" for r in rows)
    assert {r.id: (r.output, r.completed_at) for r in rows if r.id in done_before} == done_before
    assert len(list(iter_jsonl(tmp_path / "out" / "res.jsonl"))) == 8


def test_a_run_stopped_by_its_driver_gives_claims_back_without_counting_an_attempt(db_url, tmp_path, fake_decoder_cls):
    class Stopping(fake_decoder_cls):
        def generate(self, *args, **kwargs):
            raise RunStopped()

    class Crashing(fake_decoder_cls):
        def generate(self, *args, **kwargs):
            raise RuntimeError("boom")

    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=4, bad=False, batch_size=4)
    with pytest.raises(RunStopped):
        run_job(factory, job_id, Stopping())
    assert [(r.status, r.attempts) for r in _rows(factory, job_id)] == [("pending", 0)] * 4  # a clean interruption
    with pytest.raises(RuntimeError):
        resume_job(factory, job_id, Crashing())
    assert [(r.status, r.attempts) for r in _rows(factory, job_id)] == [("pending", 1)] * 4  # a crash counts one


def _dead_token() -> str:
    """The token of a process of this machine that has exited (a run killed with SIGKILL)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{holder_prefix()}{proc.pid}/dead"


def test_resume_takes_over_a_dead_process_but_never_a_live_one(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=6, bad=False)
    live = "another-host/ns1/4242/abcd"  # a live run elsewhere: its lease is all we know
    with factory.begin() as s:
        ids = queries.request_ids(s, job_id)
        request_claims.claim_requests(s, job_id, ids[:2], worker=_dead_token(), lease_seconds=3600)
        request_claims.claim_requests(s, job_id, ids[2:3], worker=live, lease_seconds=3600)
    report = run_requests(factory, job_id, fake_decoder_cls())
    assert report.completed == 3 and report.skipped == 3 and not report.finalized  # leases are respected
    dec = fake_decoder_cls()
    with pytest.raises(JobBusyError) as busy:
        resume_job(factory, job_id, dec)
    assert "process 4242 on another-host holds 1 request(s)" in str(busy.value) and dec.generate_calls == []
    with factory() as s:  # the live holder's request untouched; the dead one's given back
        counts = queries.job_counts(s, job_id)
    assert (counts["running"], counts["pending"], counts["completed"]) == (1, 2, 3)
    # the live one lets go when its lease expires (or it finishes): resume --wait then continues
    waited = []

    def lease_ends(busy_error):
        waited.append(busy_error.holders)
        with factory.begin() as s:
            s.execute(update(Request).where(Request.worker == live).values(lease_expires_at=utcnow()))

    report = resume_job(factory, job_id, dec, wait=True, poll_s=0.01, on_wait=lease_ends)
    assert len(waited) == 1 and report.completed == 3 and report.finalized
    with factory() as s:
        assert queries.job_counts(s, job_id)["completed"] == 6
        # attempts count the claims lost to a dead process or an expired lease: taken over once, never decoded twice
        assert sorted(r.attempts for r in _rows(factory, job_id)) == [0, 0, 0, 1, 1, 1]


def test_overlapping_runners_store_each_result_once(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=12, bad=False, batch_size=2)
    with factory() as s:
        ids = queries.request_ids(s, job_id)
    reports = []

    def work(subset, name):
        # lease 0: every claim expires at once, so the two runners really decode the same requests
        reports.append(
            run_requests(
                factory, job_id, fake_decoder_cls(step_delay=0.005), request_ids=subset, worker=name, lease_seconds=0
            )
        )

    threads = [threading.Thread(target=work, args=(ids[:9], "a")), threading.Thread(target=work, args=(ids[3:], "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.completed for r in reports) == 12  # each result stored exactly once
    assert sum(r.finalized for r in reports) == 1  # one of them completed the job
    assert all(r.status == "completed" for r in _rows(factory, job_id))
    assert _job(factory, job_id).status == "completed"


def test_should_stop_stops_at_the_next_step(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=10, bad=False, batch_size=2)
    done = []
    report = run_requests(
        factory,
        job_id,
        fake_decoder_cls(),
        on_progress=lambda r: done.append(r.done),
        should_stop=lambda: len(done) >= 3,
    )
    assert report.stopped == "should_stop" and report.completed == 3  # not the rest of its group of 8
    with factory() as s:
        counts = queries.job_counts(s, job_id)
    assert (counts["completed"], counts["pending"], counts["running"]) == (3, 7, 0)  # rows it stopped: given back
    assert _job(factory, job_id).status == "in_progress"
    assert run_requests(factory, job_id, fake_decoder_cls()).completed == 7


def test_cancel_stops_the_runner(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=10, bad=False, batch_size=1)

    def cancel_once(report):
        if report.done == 1:
            with factory.begin() as s:
                lifecycle.request_cancel(s, job_id)

    report = run_requests(factory, job_id, fake_decoder_cls(), on_progress=cancel_once)
    assert report.stopped == "cancelled" and report.completed == 4
    assert _job(factory, job_id).status == "cancelled"
    rep = write_results(factory, job_id, tmp_path / "cancelled.jsonl")
    assert (rep.n_output, rep.n_errors, rep.n_open) == (4, 6, 0)
    errs = list(iter_jsonl(rep.errors_path))
    assert {e["error"]["code"] for e in errs} == {"batch_cancelled"}


def test_baseline_is_measured_once_on_a_sample(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=9, bad=False, baseline_sample=3, max_tokens=WARMUP_TOKENS + 4)
    dec = fake_decoder_cls()
    b = measure_baseline(factory, job_id, dec)
    assert b is not None and b.n_requests == 3 and b.stored == 3
    assert b.baseline_output_tokens == b.sample_output_tokens  # same requests, same outputs
    assert measure_baseline(factory, job_id, dec) is None  # once per job
    # an untimed pass over each round's slice (its first tokens) warms the speculative decoder's policy and the
    # shapes, then the timed interleaved rounds: one slice of the sample each, every sampled request in one round
    assert len(dec.generate_calls) == 6
    warm, rounds = dec.generate_calls[:3], dec.generate_calls[3:]
    assert [prompts for prompts, _ in warm] == [prompts for prompts, _ in rounds]
    assert sorted(p for prompts, _ in rounds for p in prompts) == sorted(
        set(p for prompts, _ in rounds for p in prompts)
    )
    assert [p.max_new_tokens for _, params in warm for p in params] == [WARMUP_TOKENS] * 3
    assert [p.max_new_tokens for _, params in rounds for p in params] == [WARMUP_TOKENS + 4] * 3
    assert len(b.rounds) == 3 and b.speedup_low <= b.speedup <= b.speedup_high
    job = _job(factory, job_id)
    assert (job.baseline_output_tokens, job.sample_output_tokens) == (b.baseline_output_tokens, b.sample_output_tokens)
    completed = [r.line_number for r in _rows(factory, job_id) if r.status == "completed"]
    assert completed == [1, 4, 7]  # spread over the file; the sample's results are kept
    with factory() as s:
        row = summaries.job_summary_row(s, job_id)
    assert row["speedup"] == pytest.approx(
        (job.sample_output_tokens / job.sample_wall_s) / (job.baseline_output_tokens / job.baseline_wall_s)
    )
    off, _ = _make_job(factory, tmp_path, n=2, bad=False, baseline_sample=0)
    run_job(factory, off, fake_decoder_cls())
    with factory() as s:
        row = summaries.job_summary_row(s, off)
    assert row["speedup"] is None and row["baseline_tokens_per_s"] is None and row["tokens_per_s"] is not None


def test_a_file_without_valid_lines_fails_the_job(db_url, tmp_path):
    factory = make_session_factory(db_url)
    path = write_batch(tmp_path / "bad.jsonl", ["{", "[]"])
    job_id, parsed = create_job_from_file(factory, path, target="t", drafter="ngram")
    job = _job(factory, job_id)
    assert job.status == "failed" and "no valid request" in job.error and len(parsed.errors) == 2
    with factory() as s:
        assert summaries.job_summary_row(s, job_id)["n_failed"] == 2


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_full_job_with_the_default_model(db_url, tmp_path, default_decoder):
    factory = make_session_factory(db_url)
    lines = [
        chat_line("edit", "Repeat exactly: the cat sat on the mat.", max_tokens=12),
        completion_line("list", "Monday, Tuesday, Wednesday,", max_tokens=12),
        chat_line("json", 'Return {"a": 1, "b": 2} as JSON.', max_tokens=12),
        completion_line("name", "Name: Ada\nRole: engineer\nName: Bob\nRole:", max_tokens=8, stop=["\n"]),
        completion_line("too-long", "word " * 9000, max_tokens=8),
        json.dumps({"custom_id": "bad", "url": "/v1/chat/completions", "body": {"messages": [], "frobnicate": True}}),
    ]
    path = write_batch(tmp_path / "in.jsonl", lines)
    out = tmp_path / "res.jsonl"
    job_id, _parsed = create_job_from_file(
        factory,
        path,
        target=default_decoder.target_name,
        drafter=default_decoder.draft_name,
        output_file=out,
        batch_size=4,
        baseline_sample=2,
    )
    report = run_job(factory, job_id, default_decoder)
    assert report.finalized
    rows = {r.custom_id or r.line_number: r for r in _rows(factory, job_id)}
    for cid in ("edit", "list", "json", "name"):
        r = rows[cid]
        assert r.status == "completed" and r.finish_reason in ("stop", "length"), (cid, r.error)
        assert 0 < r.output_tokens <= 12 and r.target_forwards >= 1 and r.wall_s > 0
        assert r.accepted_tokens <= r.draft_tokens
    assert rows["too-long"].status == "failed" and rows["too-long"].error
    assert rows["bad"].status == "failed" and rows["bad"].error_code == "unsupported_field"  # keeps its custom_id
    results = list(iter_jsonl(out))
    assert [o["custom_id"] for o in results] == ["edit", "list", "json", "name"]
    for o in results:
        usage = o["response"]["body"]["usage"]
        assert usage["completion_tokens"] == rows[o["custom_id"]].output_tokens
        assert usage["speculative"]["drafter"] == "ngram"
    assert len(list(iter_jsonl(errors_path_for(out)))) == 2
    with factory() as s:
        summary = summaries.job_summary_row(s, job_id)
        job = queries.get_job(s, job_id)
    done = [r for r in rows.values() if r.status == "completed"]
    assert summary["status"] == "completed" and summary["n_completed"] == 4 and summary["n_failed"] == 2
    assert summary["output_tokens"] == sum(r.output_tokens for r in done)
    assert summary["tokens_per_step"] == pytest.approx(
        sum(r.output_tokens for r in done) / sum(r.target_forwards for r in done)
    )
    assert summary["speedup"] is not None and summary["speedup"] > 0 and job.baseline_requests == 2
    assert summary["tokens_per_s"] == pytest.approx(summary["output_tokens"] / job.decode_wall_s)


def test_resume_finishes_a_job_killed_while_finalizing(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=3, bad=False)
    run_requests(factory, job_id, fake_decoder_cls(), finalize=False)
    with factory.begin() as s:
        assert lifecycle.begin_finalizing(s, job_id)  # ... and the process died before writing the output
    report = resume_job(factory, job_id, fake_decoder_cls())
    assert report.finalized and _job(factory, job_id).status == "completed"
    assert len(list(iter_jsonl(tmp_path / "out" / "res.jsonl"))) == 3


def test_a_long_group_renews_its_leases(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id, _ = _make_job(factory, tmp_path, n=6, bad=False, batch_size=8)
    leases = []

    def watch(report):
        with factory() as s:
            leases.append(
                s.scalar(
                    select(Request.lease_expires_at)
                    .where(Request.job_id == job_id, Request.status == "running")
                    .order_by(Request.line_number.desc())
                    .limit(1)
                )
            )

    report = run_requests(factory, job_id, fake_decoder_cls(step_delay=0.03), lease_seconds=0.06, on_progress=watch)
    assert report.completed == 6
    seen = [lease for lease in leases if lease is not None]
    assert len(set(seen)) >= 2  # the last request's lease was extended while the others finished


def test_decode_errors_name_the_line_and_custom_id_never_a_batch_index(db_url, tmp_path, tiny_decoder):
    factory = make_session_factory(db_url)
    decoder = tiny_decoder("ngram")
    lines = [
        completion_line("a", [1, 2, 3], max_tokens=4),
        completion_line("b", [4, 5], max_tokens=4),
        completion_line("long", [7] * (decoder.max_context + 5), max_tokens=4),
    ]
    out = tmp_path / "out.jsonl"
    job_id, _ = create_job_from_file(
        factory,
        write_batch(tmp_path / "in.jsonl", lines),
        target="tiny",
        drafter="ngram",
        baseline_sample=0,
        output_file=out,
    )
    run_job(factory, job_id, decoder)
    err = next(iter_jsonl(errors_path_for(out)))["response"]["body"]["error"]
    assert err["message"].startswith(f"line 3, custom_id 'long': the prompt has {decoder.max_context + 5} tokens")
    assert "prompt 2" not in err["message"]  # its place in the batch means nothing to the user


def test_request_error_takes_the_prompt_error_of_its_own_index_only():
    from spec_batch.core.outputs import GenerationResult, RequestStats
    from spec_batch.errors import PromptTooLongError
    from spec_batch.jobs.runner import request_error

    exc = PromptTooLongError("prompt 2 has 9 tokens", prompt_index=2, detail="the prompt has 9 tokens")
    result = GenerationResult("", [], "error", RequestStats(), error=str(exc), prompt_error=exc)
    assert request_error(result, 2) == "the prompt has 9 tokens"
    assert request_error(result, 3) == "prompt 2 has 9 tokens"  # another prompt's error: the text as it is
    assert request_error(GenerationResult("", [], "error", RequestStats(), error="boom"), 0) == "boom"
    assert request_error(GenerationResult("", [], "error", RequestStats()), 0) == "decoding failed"
