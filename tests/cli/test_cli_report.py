"""`spec-batch report`: jobs and history pages from the job database, and the command's usage errors."""

from __future__ import annotations

import re

from batch_lines import completion_line, write_batch
from click.testing import CliRunner

from spec_batch.cli import main
from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.store import make_session_factory


def _invoke(url: str, *args: str):
    return CliRunner().invoke(main, list(args), env={"SPEC_BATCH_DATABASE_URL": url})


def _job(factory, tmp_path, name: str, fake_decoder_cls) -> str:
    path = write_batch(
        tmp_path / f"{name}.jsonl", [completion_line(f"{name}{i}", f"p{i}", max_tokens=9) for i in range(5)]
    )
    job_id, _ = create_job_from_file(factory, path, target="fake-target", drafter="ngram", baseline_sample=2)
    run_job(factory, job_id, fake_decoder_cls())
    return job_id


def test_report_of_jobs_and_history(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    a = _job(factory, tmp_path, "a", fake_decoder_cls)
    b = _job(factory, tmp_path, "b", fake_decoder_cls)
    out = tmp_path / "reports" / "jobs.html"
    r = _invoke(db_url, "report", a[:12], b, a, "-o", str(out))  # a prefix; a job named twice is shown once
    assert r.exit_code == 0, r.output
    assert f"report -> {out}" in r.output
    html = out.read_text(encoding="utf-8")
    assert re.findall(r'<section class="job" id="([^"]+)"', html) == [a, b]
    assert "Jobs in this report" in html and "a0" in html and "b4" in html
    assert html.count('data-chart="acceptance-by-position"') == 2

    out = tmp_path / "history.html"
    r = _invoke(db_url, "report", "--history", "--since", "2000-01-01", "-o", str(out))
    assert r.exit_code == 0, r.output
    html = out.read_text(encoding="utf-8")
    assert a in html and b in html and "fake-target + ngram" in html and "since 2000-01-01 00:00:00 UTC" in html
    r = _invoke(db_url, "report", "--history", "--since", "2999-01-01T00:00+02:00", "-o", str(out), "--force")
    assert r.exit_code == 0 and a not in out.read_text(encoding="utf-8")


def test_report_usage_errors(db_url, tmp_path):
    out = str(tmp_path / "r.html")
    for args, message in [
        ((), "give at least one JOB id"),
        (("job_x", "--history"), "not both"),
        (("latest", "--since", "2026-01-01"), "--since goes with --history"),
        (("--history", "--since", "last week"), "is not a date"),
        (("job_nope",), "no job 'job_nope'"),
    ]:
        r = _invoke(db_url, "report", *args, "-o", out)
        assert r.exit_code != 0 and message in r.output, (args, r.output)
    assert not (tmp_path / "r.html").exists()
