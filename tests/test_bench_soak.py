"""bench/soak_server.py: its checks refuse what they must (no model), and a short soak on SQLite holds (slow)."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from bench import soak_batches, soak_clients, soak_server
from bench.soak_monitor import Ledger, Minute, Record, latency_drift


def _usage(n):
    return NS(completion_tokens=n)


def test_stream_check_wants_one_finish_one_id_and_usage_within_max_tokens():
    assert soak_clients.stream_problem(["stop"], {"a"}, _usage(5), 8) == ""
    assert soak_clients.stream_problem(["length"], {"a"}, _usage(8), 8) == ""
    assert "finish" in soak_clients.stream_problem([], {"a"}, _usage(5), 8)  # cut short: no finish reason
    assert "finish" in soak_clients.stream_problem(["stop", "stop"], {"a"}, _usage(5), 8)  # answered twice
    assert "ids" in soak_clients.stream_problem(["stop"], {"a", "b"}, _usage(5), 8)  # two answers interleaved
    assert "usage" in soak_clients.stream_problem(["stop"], {"a"}, None, 8)
    assert soak_clients.stream_problem(["stop"], {"a"}, _usage(9), 8)
    assert soak_clients.stream_problem(["length"], {"a"}, _usage(3), 8)  # length before max_tokens


def _reply(finish, content=None, calls=(), n=4):
    message = NS(content=content, tool_calls=list(calls))
    return NS(choices=[NS(finish_reason=finish, message=message)], usage=_usage(n))


def test_answer_check_of_tools_and_json_schema():
    call = NS(function=NS(name="get_weather", arguments='{"city": "Oslo"}'))
    assert soak_clients.answer_problem(_reply("tool_calls", calls=[call]), "tools", 8) == ""
    assert soak_clients.answer_problem(_reply("stop", content="Oslo"), "tools", 8)
    assert soak_clients.answer_problem(_reply("stop", '{"answer": "yes", "why": "x"}'), "json_schema", 8) == ""
    assert soak_clients.answer_problem(_reply("stop", '{"answer": "maybe", "why": ""}'), "json_schema", 8)
    assert soak_clients.answer_problem(_reply("length", "{", n=8), "json_schema", 8) == ""
    assert soak_clients.answer_problem(NS(choices=[], usage=_usage(1)), "json_schema", 8)


def _batch(status, total, completed, failed):
    return NS(id="batch_x", status=status, request_counts=NS(total=total, completed=completed, failed=failed))


def test_batch_check_wants_every_line_in_exactly_one_result_file():
    ids = ["s-0", "s-1", "s-2"]
    ok = _batch("completed", 3, 2, 1)
    assert soak_batches.batch_problem(ok, ids, "s-2", ["s-0", "s-1"], ["s-2"], False) == ""
    assert "missing" in soak_batches.batch_problem(ok, ids, "s-2", ["s-0"], ["s-2"], False)
    assert "repeated" in soak_batches.batch_problem(ok, ids, "s-2", ["s-0", "s-1"], ["s-2", "s-1"], False)
    assert "bad line" in soak_batches.batch_problem(ok, ids, "s-2", ["s-0", "s-2"], ["s-1"], False)
    assert "request_counts" in soak_batches.batch_problem(
        _batch("completed", 3, 3, 0), ids, "s-2", ["s-0", "s-1"], ["s-2"], False
    )
    cancelled = _batch("cancelled", 3, 1, 2)
    assert soak_batches.batch_problem(cancelled, ids, "s-2", ["s-0"], ["s-1", "s-2"], True) == ""
    assert "ended cancelled" in soak_batches.batch_problem(cancelled, ids, "s-2", ["s-0"], ["s-1", "s-2"], False)


def test_batch_file_has_one_line_per_id_and_a_bad_last_line():
    import random

    ids, bad, content = soak_batches.batch_file(random.Random(0), "t", 4, 8)
    lines = [json.loads(x) for x in content.decode().splitlines()]
    assert [x["custom_id"] for x in lines] == ids and bad == ids[-1] and len(set(ids)) == 4
    assert lines[-1]["body"]["temperature"] == -1 and all(x["body"]["temperature"] == 0 for x in lines[:-1])


def test_final_check_refuses_errors_stuck_clients_and_rows_left_in_progress():
    ledger = Ledger()
    ledger.add(Record("stream", 0, 1, "complete", 4))
    ledger.add(Record("batch", 0, 1, "complete", 4))
    end = {"stuck_clients": [], "in_progress_at_end": 0.0}
    assert soak_server.failures(ledger, end, -15, "") == []
    assert soak_server.failures(ledger, end, 1, "")  # the server did not exit cleanly
    assert soak_server.failures(ledger, {**end, "in_progress_at_end": 1.0}, 0, "")
    assert soak_server.failures(ledger, {**end, "stuck_clients": ["stream-0"]}, 0, "")
    ledger.add(Record("tools", 0, 1, "error", 0, "HTTP 500"))
    assert soak_server.failures(ledger, end, 0, "") == ["tools: HTTP 500"]
    assert soak_server.failures(Ledger(), end, 0, "")  # nothing completed is no soak


def test_server_count_of_answers_must_match_the_clients():
    ledger = Ledger()
    for outcome in ("complete", "complete", "cancelled"):
        ledger.add(Record("stream" if outcome == "complete" else "disconnect", 0, 1, outcome))
    assert soak_server.counted_problems(ledger, {"completed": 2, "failed": 0}) == []
    assert soak_server.counted_problems(ledger, {"completed": 3, "failed": 0}) == []  # finished as it was dropped
    assert soak_server.counted_problems(ledger, {"completed": 1, "failed": 0})  # an answer the server never counted
    assert soak_server.counted_problems(ledger, {"completed": 4, "failed": 0})  # answered twice
    assert soak_server.counted_problems(ledger, {"completed": 2, "failed": 1})


def test_latency_drift_compares_first_and_last_windows_with_answers():
    def minute(p50, answers=10):
        return Minute(1, 1, 1, 1, 1, 0, answers, answers, 0, 0, p50, 2 * p50, 1, 0)

    drift = latency_drift([minute(1.0), *[minute(2.0)] * 8, minute(3.0), minute(0.0, answers=0)])
    assert drift == {"p50_first_s": 1.5, "p50_last_s": 2.5, "p95_first_s": 3.0, "p95_last_s": 5.0}


@pytest.mark.slow
def test_a_short_soak_on_sqlite_holds(tmp_path):
    out = tmp_path / "soak.json"
    args = ["--minutes", "0.4", "--interval", "10", "--out", str(out), "--workdir", str(tmp_path), "--max-tokens", "8"]
    args += [
        "--streaming",
        "2",
        "--structured",
        "1",
        "--batch-lines",
        "2",
        "--cancel-share",
        "0",
        "--drain-minutes",
        "3",
    ]
    assert soak_server.main(args) == 0, out.read_text()
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["end"]["in_progress_at_end"] == 0
    assert result["end"]["server_counted"]["completed"] >= result["totals"]["stream"]["complete"]
    assert result["totals"]["stream"]["complete"] >= 1 and result["totals"]["batch"]["complete"] >= 1
    assert all(m["db_connections"] >= 1 and m["rss_mb"] > 0 for m in result["per_minute"])
