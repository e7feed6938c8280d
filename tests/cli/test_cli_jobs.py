"""`spec-batch run | resume | jobs | show | results | stats | db`: the history commands, and a run killed
with SIGKILL that `spec-batch resume` finishes without losing or repeating anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batch_lines import chat_line, completion_line, write_batch
from click.testing import CliRunner
from db_fixtures import create_pg_database, drop_pg_database
from sqlalchemy import select

from spec_batch.cli import main
from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.jobs.batch_output import errors_path_for, iter_jsonl
from spec_batch.store import (
    Request,
    current_revision,
    head_revision,
    make_engine,
    make_session_factory,
    queries,
    request_claims,
    summaries,
)

SPEC_BATCH = str(Path(sys.executable).with_name("spec-batch"))


def _invoke(url: str, *args: str):
    return CliRunner().invoke(main, list(args), env={"SPEC_BATCH_DATABASE_URL": url}, catch_exceptions=False)


def test_history_commands(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    path = write_batch(
        tmp_path / "in.jsonl", [completion_line(f"c{i}", f"p{i}", max_tokens=3) for i in range(4)] + ["{bad json"]
    )
    job_id, _ = create_job_from_file(
        factory, path, target="fake-target", drafter="ngram", baseline_sample=2, metadata={"team": "docs"}
    )
    run_job(factory, job_id, fake_decoder_cls())

    r = _invoke(db_url, "jobs", "--limit", "100")
    assert r.exit_code == 0 and job_id in r.output and "completed" in r.output
    r = _invoke(db_url, "jobs", "--json", "--limit", "500")
    rows = [json.loads(line) for line in r.output.splitlines()]
    mine = next(x for x in rows if x["job_id"] == job_id)
    assert (mine["n_requests"], mine["n_completed"], mine["n_failed"]) == (5, 4, 1) and mine["speedup"] is not None

    r = _invoke(db_url, "show", job_id[:12])
    assert r.exit_code == 0, r.output
    assert job_id in r.output and "invalid_json" in r.output and "team" in r.output and "speedup" in r.output

    out = tmp_path / "export" / "res.jsonl"
    r = _invoke(db_url, "results", job_id, "-o", str(out))
    assert r.exit_code == 0 and "4 result(s)" in r.output and "1 error(s)" in r.output
    assert [o["custom_id"] for o in iter_jsonl(out)] == ["c0", "c1", "c2", "c3"]
    assert next(iter_jsonl(errors_path_for(out)))["error"]["line"] == 5

    r = _invoke(db_url, "stats")
    assert r.exit_code == 0 and "fake-target" in r.output
    r = _invoke(db_url, "stats", "--json")
    stats = [json.loads(line) for line in r.output.splitlines()]
    assert any(s["target"] == "fake-target" and s["jobs_measured"] >= 1 for s in stats)

    r = _invoke(db_url, "show", "job_does_not_exist")
    assert r.exit_code != 0 and "no job" in r.output
    r = _invoke(db_url, "db", "current")
    assert r.exit_code == 0 and f"current: {head_revision()}" in r.output


def test_db_upgrade_migrates_a_server(pg_admin):
    url = create_pg_database(pg_admin)
    try:
        r = _invoke(url, "jobs")  # a server is not migrated implicitly: a clear message
        assert r.exit_code != 0 and "spec-batch db upgrade" in r.output
        r = _invoke(url, "db", "upgrade")
        assert r.exit_code == 0 and head_revision() in r.output
        assert current_revision(make_engine(url)) == head_revision()
        r = _invoke(url, "jobs")
        assert r.exit_code == 0 and "no jobs yet" in r.output
    finally:
        drop_pg_database(url)


def test_run_with_an_unknown_model_creates_no_job(tmp_path):
    url = f"sqlite:///{tmp_path / 'j.db'}"
    path = write_batch(tmp_path / "in.jsonl", [completion_line("a", "x")])
    r = _invoke(url, "run", str(path), "--target", str(tmp_path / "missing.gguf"))
    assert r.exit_code != 0 and "missing.gguf" in r.output
    r = _invoke(url, "jobs")
    assert "no jobs yet" in r.output


KILL_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Monday, Tuesday, Wednesday, Thursday,",
    "1, 2, 3, 4, 5, 6, 7,",
    "Dear customer, your invoice 1042 is overdue. Dear customer, your invoice",
    "red, green, blue, red, green,",
    "Name: Ada\nRole: engineer\nName: Linus\nRole:",
    "SELECT customer FROM invoices; SELECT",
    "To install, run make setup. To test, run",
]


@pytest.mark.slow
def test_run_killed_then_resumed_loses_nothing(tmp_path, default_decoder):
    lines = [completion_line(f"r{i}", p, max_tokens=12) for i, p in enumerate(KILL_PROMPTS)]
    lines.insert(3, chat_line("chat", "Repeat exactly: the report is due on Friday.", max_tokens=12))
    path = write_batch(tmp_path / "in.jsonl", lines)
    n = len(lines)
    db = tmp_path / "killed.db"
    env = {**os.environ, "SPEC_BATCH_DATABASE_URL": f"sqlite:///{db}"}
    out = tmp_path / "out.jsonl"
    args = [SPEC_BATCH, "run", str(path), "-o", str(out), "--batch-size", "4", "--baseline-sample", "0"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    factory = None
    done = 0
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            if factory is None and db.exists():
                factory = make_session_factory(f"sqlite:///{db}")
            if factory is not None:
                try:
                    with factory() as s:
                        done = s.query(Request).filter(Request.status == "completed").count()
                except Exception:
                    continue
                if done >= 2:
                    break
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read().decode()}"
        assert done >= 2, "no results stored in time"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    with factory() as s:
        job_id = queries.resolve_job_id(s, "latest")
        counts = queries.job_counts(s, job_id)
        before = {
            r.id: (r.output, r.completed_at)
            for r in s.scalars(select(Request).where(Request.job_id == job_id, Request.status == "completed"))
        }
    assert 2 <= counts["completed"] < n and counts["completed"] + counts["pending"] + counts["running"] == n
    assert not out.exists()

    res = subprocess.run(
        [SPEC_BATCH, "resume", job_id], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "completed" in res.stdout and job_id in res.stdout
    with factory() as s:
        rows = s.scalars(select(Request).where(Request.job_id == job_id)).all()
        summary = summaries.job_summary_row(s, job_id)
    assert len(rows) == n and all(r.status == "completed" for r in rows)
    assert {r.id: (r.output, r.completed_at) for r in rows if r.id in before} == before  # finished work kept
    assert summary["status"] == "completed" and summary["n_completed"] == n
    resumed = {o["custom_id"]: o for o in iter_jsonl(out)}
    assert len(resumed) == n

    # The same file, uninterrupted (in one batch: a row's output never depends on its batch): same outputs.
    ref_factory = make_session_factory(f"sqlite:///{tmp_path / 'ref.db'}")
    from spec_batch.store import migrate_to_head

    migrate_to_head(f"sqlite:///{tmp_path / 'ref.db'}")
    ref_id, _ = create_job_from_file(
        ref_factory,
        path,
        target="default",
        drafter="ngram",
        batch_size=n,
        baseline_sample=0,
        output_file=tmp_path / "ref.jsonl",
    )
    run_job(ref_factory, ref_id, default_decoder)
    reference = {o["custom_id"]: o for o in iter_jsonl(tmp_path / "ref.jsonl")}

    def text(o):
        choice = o["response"]["body"]["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content"))

    assert {k: text(v) for k, v in resumed.items()} == {k: text(v) for k, v in reference.items()}


@pytest.mark.parametrize(
    "args",
    [
        ["jobs"],
        ["show", "latest"],
        ["stats"],
        ["results", "latest", "-o", "x.jsonl"],
        ["wait", "latest"],
        ["cancel", "latest"],
        ["resume", "latest"],
        ["db", "current"],
    ],
)
def test_read_only_commands_on_a_missing_database_create_nothing(tmp_path, args):
    db = tmp_path / "nowhere" / "jobs.db"
    r = _invoke(f"sqlite:///{db}", *args)
    assert r.exit_code == 1 and f"the database {db} does not exist" in r.output, r.output
    assert not db.exists() and not db.parent.exists()


def test_resume_refuses_a_job_a_live_process_holds(tmp_path, fake_decoder_cls):
    url = f"sqlite:///{tmp_path / 'j.db'}"
    from spec_batch.store import migrate_to_head

    migrate_to_head(url)
    factory = make_session_factory(url)
    path = write_batch(tmp_path / "in.jsonl", [completion_line(f"c{i}", f"p{i}", max_tokens=3) for i in range(3)])
    job_id, _ = create_job_from_file(factory, path, target="fake-target", drafter="ngram", baseline_sample=0)
    with factory.begin() as s:  # the original `spec-batch run`, still alive on another machine
        request_claims.claim_requests(
            s, job_id, queries.request_ids(s, job_id)[:1], worker="elsewhere/ns1/77/ab", lease_seconds=600
        )
    r = _invoke(url, "resume", job_id)
    assert r.exit_code == 5 and "process 77 on elsewhere holds 1 request(s)" in r.output, r.output
    assert "--wait" in r.output
    with factory() as s:
        assert queries.job_counts(s, job_id)["running"] == 1  # nothing taken over
