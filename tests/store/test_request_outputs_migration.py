"""Migration 0005: invalid lines keep their custom_id (a partial unique index over valid rows), old invalid rows
are backfilled from their stored line, and the downgrade restores the old rule; options and choices columns."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from spec_batch.store.db import _run, downgrade, make_engine

ROW = (
    "INSERT INTO requests (job_id, custom_id, line_number, input, endpoint, status, attempts) "
    "VALUES ('j', :c, :n, :i, :e, :s, 0)"
)


def _job(conn) -> None:
    conn.execute(
        text(
            "INSERT INTO jobs (id, status, target, drafter, sampling_defaults, batch_size, baseline_sample, "
            "n_requests, n_invalid, decode_wall_s, created_at) VALUES ('j', 'in_progress', 't', 'ngram', "
            "'{}', 8, 0, 3, 2, 0, CURRENT_TIMESTAMP)"
        )
    )


def test_0005_keeps_custom_ids_of_invalid_lines_and_downgrades(empty_db_url):
    engine = make_engine(empty_db_url)
    _run(engine, "upgrade", "0004_baseline_samples")
    with engine.begin() as conn:  # rows as 0004 stored them: invalid lines without their custom_id
        _job(conn)
        conn.execute(text(ROW), {"c": "a", "n": 1, "i": '{"custom_id": "a"}', "e": "/v1/completions", "s": "pending"})
        conn.execute(text(ROW), {"c": None, "n": 2, "i": '{"custom_id": "a", "bad": 1}', "e": None, "s": "failed"})
        conn.execute(text(ROW), {"c": None, "n": 3, "i": "not json", "e": None, "s": "failed"})
    _run(engine, "upgrade", "0005_request_outputs")
    with engine.begin() as conn:
        got = conn.execute(text("SELECT line_number, custom_id FROM requests ORDER BY line_number")).all()
        assert [tuple(r) for r in got] == [(1, "a"), (2, "a"), (3, None)]  # backfilled from the stored line
    with pytest.raises(IntegrityError), engine.begin() as conn:  # still unique among valid rows
        conn.execute(text(ROW), {"c": "a", "n": 4, "i": "{}", "e": "/v1/completions", "s": "pending"})
    columns = {c["name"] for c in inspect(engine).get_columns("requests")}
    assert {"options", "choices"} <= columns
    assert "job_summary" in inspect(engine).get_view_names()
    downgrade(engine, "0004_baseline_samples")
    with engine.begin() as conn:  # the old rule: NULL for invalid lines, then a plain unique constraint
        got = conn.execute(text("SELECT line_number, custom_id FROM requests ORDER BY line_number")).all()
        assert [tuple(r) for r in got] == [(1, "a"), (2, None), (3, None)]
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text(ROW), {"c": "a", "n": 5, "i": "{}", "e": None, "s": "failed"})
    assert "job_summary" in inspect(engine).get_view_names()
    engine.dispose()
