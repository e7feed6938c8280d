"""Honest rates after a crash: each stored result commits the decode time that produced it in the same
transaction, so a process killed with SIGKILL has its stored tokens and their time counted, and neither of the
rest. A resume then gives the job the tokens/s of the work it kept."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from batch_lines import completion_line, write_batch

from spec_batch.jobs import create_job_from_file, resume_job
from spec_batch.store import make_session_factory, queries, summaries

STEP_S = 0.2  # seconds per result of the killed process's decoder
KILLED_AFTER = 3  # results it stores before SIGKILL

KILLED_RUN = textwrap.dedent("""
    import os, signal, sys, time
    from spec_batch.core.outputs import GenerationResult, RequestStats
    from spec_batch.jobs.runner import run_requests
    from spec_batch.store import make_session_factory

    class SlowDecoder:
        def generate(self, prompts, params, batch_size=8, *, return_errors=False, on_result=None, should_stop=None,
                     memory=None):
            for i, _ in enumerate(prompts):
                if i == {killed_after}:
                    os.kill(os.getpid(), signal.SIGKILL)  # no finally block, no atexit: a crash
                time.sleep({step_s})
                on_result(i, GenerationResult("ok", [1, 2], "length", RequestStats(output_tokens=2, target_forwards=1)))

    run_requests(make_session_factory(sys.argv[1]), sys.argv[2], SlowDecoder(), batch_size=8)
""")


def test_a_killed_process_keeps_its_tokens_and_their_decode_time(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    path = write_batch(tmp_path / "in.jsonl", [completion_line(f"r{i}", f"p{i}", max_tokens=3) for i in range(6)])
    job_id, _ = create_job_from_file(factory, path, target="t", drafter="ngram", baseline_sample=0, batch_size=8)
    script = KILLED_RUN.format(killed_after=KILLED_AFTER, step_s=STEP_S)
    proc = subprocess.run([sys.executable, "-c", script, db_url, job_id], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with factory() as s:
        counts = queries.job_counts(s, job_id)
        killed = summaries.job_summary_row(s, job_id)
        decode_s = queries.get_job(s, job_id).decode_wall_s
    assert counts["completed"] == KILLED_AFTER and counts["running"] == 6 - KILLED_AFTER  # left by the dead
    assert killed["output_tokens"] == 2 * KILLED_AFTER
    # the three stored results and the time that produced them (not 0 s, which would read as infinite tokens/s)
    assert decode_s == pytest.approx(KILLED_AFTER * STEP_S, rel=0.5)
    assert killed["tokens_per_s"] == pytest.approx(2 / STEP_S, rel=0.5)

    report = resume_job(factory, job_id, fake_decoder_cls())  # the dead process's claims are taken over at once
    assert report.completed == 6 - KILLED_AFTER and report.finalized
    with factory() as s:
        job = queries.get_job(s, job_id)
        row = summaries.job_summary_row(s, job_id)
    assert job.decode_wall_s == pytest.approx(decode_s + report.decode_wall_s)
    assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / job.decode_wall_s)
