"""The report queries (spec_batch.store.report_queries) and the per-request baseline table on a real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from batch_lines import completion_line, write_batch

from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.store import make_session_factory, queries, summaries
from spec_batch.store.baselines import SamplePair, record_baseline_samples
from spec_batch.store.models import utcnow
from spec_batch.store.report_queries import job_history, job_report_data


def _job(factory, tmp_path, n=6, **kw):
    path = write_batch(
        tmp_path / f"in{n}.jsonl", [completion_line(f"c{i}", f"prompt {i}", max_tokens=8) for i in range(n)] + ["{bad"]
    )
    job_id, _ = create_job_from_file(factory, path, target="fake-target", drafter="ngram", **kw)
    return job_id


def test_job_report_data_matches_job_summary(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, baseline_sample=2, batch_size=2)
    run_job(factory, job_id, fake_decoder_cls())
    with factory() as s:
        data = job_report_data(s, job_id)
        summary = summaries.job_summary_row(s, job_id)
    assert data.summary == summary and data.batch_size == 2
    assert len(data.baseline) == data.baseline_requests == 2  # measure_baseline stored each sampled pair
    assert {b.custom_id for b in data.baseline} <= {f"c{i}" for i in range(6)}
    assert [r.line_number for r in data.requests] == list(range(1, 8))  # line order, the invalid line included
    assert data.requests[-1].status == "failed" and data.requests[-1].output_tokens is None
    assert sum(r.output_tokens or 0 for r in data.requests) == summary["output_tokens"]
    assert sum(r.target_forwards or 0 for r in data.requests) * summary["tokens_per_step"] == pytest.approx(
        summary["output_tokens"]
    )
    done = [r for r in data.requests if r.status == "completed"]
    assert len(done) == 6 and all(r.completed_at is not None and r.started_at is not None for r in done)


def test_baseline_samples_are_read_back_in_line_order(db_url, tmp_path):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, baseline_sample=2)
    with factory() as s:
        ids = queries.request_ids(s, job_id)
    pairs = [SamplePair(ids[3], 30, 10, 0.5, 30, 1.5), SamplePair(ids[0], 20, 20, 0.4, 20, 0.8)]
    with factory.begin() as s:
        record_baseline_samples(s, job_id, pairs)
    with factory() as s:
        got = job_report_data(s, job_id).baseline
    assert [(b.custom_id, b.line_number) for b in got] == [("c0", 1), ("c3", 4)]
    assert (got[1].speculative_output_tokens, got[1].speculative_target_forwards, got[1].baseline_wall_s) == (
        30,
        10,
        1.5,
    )


def test_job_history_is_oldest_first_and_filters_by_creation_time(db_url, tmp_path):
    factory = make_session_factory(db_url)
    first = _job(factory, tmp_path, n=1)
    second = _job(factory, tmp_path, n=2)
    with factory() as s:
        rows = job_history(s)
        created = {r["job_id"]: r["created_at"] for r in rows}
        assert [r["job_id"] for r in rows if r["job_id"] in (first, second)] == [first, second]
        later = job_history(s, since=created[second])
        assert second in [r["job_id"] for r in later] and first not in [r["job_id"] for r in later]
        assert job_history(s, since=utcnow() + timedelta(days=1)) == []
