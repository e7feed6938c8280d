"""Ctrl-C is not a lost attempt: a real `spec-batch run` interrupted with SIGINT during its
baseline phase, then resumed and interrupted again, gives its claims back without counting; the job then resumes
to completion with every request's attempts at 0 (SPEC_BATCH_MAX_ATTEMPTS never comes near)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batch_lines import completion_line, write_batch
from sqlalchemy import select

from spec_batch.store import Request, make_session_factory, queries, summaries

SPEC_BATCH = str(Path(sys.executable).with_name("spec-batch"))
INTERRUPTS = 2  # interrupted, resumed and interrupted again, then resumed to the end
PROMPTS = ["The capital of France is", "One, two, three, four,", "Roses are red, violets are", "Monday, Tuesday,"]


def _requests(factory, job_id):
    with factory() as s:
        return s.scalars(select(Request).where(Request.job_id == job_id)).all()


def _as_from_a_terminal() -> None:
    """The child gets SIGINT's default action, as a command started from a terminal does. A test run started in the
    background by a non-interactive shell (CI's, `cmd &`) has SIGINT ignored, the child would inherit that, and
    Python then leaves Ctrl-C ignored: the run would finish instead of stopping."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_during_the_baseline(args, env, cwd, factory_for, job_id=None) -> str:
    """Starts `args`, waits until its baseline sample is claimed (running in SQL, no baseline stored yet), sends
    SIGINT and waits for the exit. Returns the job id."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            factory = factory_for()
            if factory is None:
                continue
            try:
                with factory() as s:
                    job_id = job_id or queries.resolve_job_id(s, "latest")
                    running = queries.job_counts(s, job_id)["running"]
            except Exception:
                continue
            if running:
                break
        assert proc.poll() is None, f"the run ended before it could be interrupted:\n{proc.stdout.read()}"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out  # EXIT_INTERRUPTED
    assert f"spec-batch resume {job_id}" in out
    return job_id


@pytest.mark.slow
def test_sigint_during_the_baseline_counts_no_attempt_and_the_job_resumes(tmp_path):
    path = write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", p, max_tokens=12) for i, p in enumerate(PROMPTS)]
    )
    db = tmp_path / "jobs.db"
    url = f"sqlite:///{db}"
    env = {**os.environ, "SPEC_BATCH_DATABASE_URL": url}
    out = tmp_path / "out.jsonl"
    factories = {}

    def factory_for():
        if "f" not in factories and db.exists():
            factories["f"] = make_session_factory(url)
        return factories.get("f")

    run = [SPEC_BATCH, "run", str(path), "-o", str(out), "--batch-size", "4", "--baseline-sample", "4"]
    job_id = _interrupt_during_the_baseline(run, env, tmp_path, factory_for)
    for i in range(INTERRUPTS):
        factory = factory_for()
        with factory() as s:
            job = queries.get_job(s, job_id)
            assert job.baseline_wall_s is None, "the interrupt came after the baseline: not the case under test"
        rows = _requests(factory, job_id)
        assert [r.attempts for r in rows] == [0] * len(PROMPTS), f"interrupt {i + 1}"
        assert {r.status for r in rows} == {"pending"}  # every claim given back at once
        if i + 1 < INTERRUPTS:
            _interrupt_during_the_baseline([SPEC_BATCH, "resume", job_id], env, tmp_path, factory_for, job_id)

    res = subprocess.run(
        [SPEC_BATCH, "resume", job_id], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _requests(factory_for(), job_id)
    assert all(r.status == "completed" for r in rows) and all(r.attempts == 0 for r in rows)
    with factory_for()() as s:
        summary = summaries.job_summary_row(s, job_id)
    assert summary["status"] == "completed" and summary["speedup"] is not None
    assert summary["speedup_low"] <= summary["speedup"] <= summary["speedup_high"]
    assert len(out.read_text().splitlines()) == len(PROMPTS)
