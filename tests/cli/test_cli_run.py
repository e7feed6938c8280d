"""`spec-batch run` as a script sees it: the job id alone on stdout's first line, exit codes that say how the
job ended, and every file check done before the model loads (the model here is the fake decoder)."""
from __future__ import annotations

import json
import os
import stat

import pytest
from click.testing import CliRunner

from batch_lines import chat_line, completion_line, write_batch
from spec_batch.cli import _common, main
from spec_batch.cli import jobs as cli_jobs
from spec_batch.store import make_session_factory, queries


@pytest.fixture
def env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    return url


@pytest.fixture
def loads(monkeypatch, fake_decoder_cls):
    """The decoders `run` loaded (the fake one); `loads.decoder` is handed out."""

    class Loads(list):
        decoder = fake_decoder_cls()

    calls = Loads()

    def load(target, draft, device, dtype, *precision):  # precision: --weights, --draft-weights (issue 26)
        calls.append((target, draft))
        return calls.decoder

    monkeypatch.setattr(cli_jobs, "_load_decoder", load)
    return calls


def _run(*args: str):
    return CliRunner().invoke(main, ["run", *args])


def _lines(tmp_path, n: int = 3, extra: tuple[str, ...] = ()):
    return write_batch(tmp_path / "in.jsonl", [completion_line(f"r{i}", f"prompt {i}", max_tokens=5)
                                               for i in range(n)] + list(extra))


def test_the_job_id_is_stdouts_first_line_and_a_completed_job_exits_0(env, tmp_path, loads):
    out = tmp_path / "out.jsonl"
    res = _run(str(_lines(tmp_path)), "-o", str(out), "--baseline-sample", "0")
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    job_id = res.stdout.splitlines()[0]
    assert job_id.startswith("job_") and job_id.split() == [job_id]  # JOB=$(spec-batch run ... | head -1)
    assert "interrupted?" not in res.output and "resume" not in res.stderr  # no hint when nothing went wrong
    assert len(out.read_text().splitlines()) == 3
    with make_session_factory(env)() as s:
        assert queries.get_job(s, job_id).status == "completed"


def test_an_interrupted_run_says_how_to_resume_and_exits_130(env, tmp_path, loads, fake_decoder_cls):
    loads.decoder = fake_decoder_cls(interrupt_after=1)
    res = _run(str(_lines(tmp_path)), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    job_id = res.stdout.splitlines()[0]
    assert res.exit_code == _common.EXIT_INTERRUPTED
    assert f"spec-batch resume {job_id}" in res.stderr


@pytest.mark.parametrize("lines", [[], ["{not json", json.dumps({"custom_id": "x"})]], ids=["empty", "all-invalid"])
def test_no_valid_line_fails_before_the_model_loads(env, tmp_path, loads, lines):
    path = write_batch(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = _run(str(path), "-o", str(out))
    assert res.exit_code == _common.EXIT_FAILED, res.output
    assert loads == []  # the model never loaded
    job_id = res.stdout.splitlines()[0]
    with make_session_factory(env)() as s:
        assert queries.get_job(s, job_id).status == "failed"
    if lines:
        assert len((tmp_path / "out.errors.jsonl").read_text().splitlines()) == 2


def test_lines_the_model_cannot_run_are_refused_at_validation(env, tmp_path, loads):
    path = write_batch(tmp_path / "in.jsonl", [completion_line("ok", "fine", max_tokens=5),
                                               completion_line("huge", "x", max_tokens=10**12)])
    res = _run(str(path), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    assert "line 2: body.max_tokens: 1000000000000 leaves no room for the prompt in the model's context" in res.stderr
    assert all(prompts != ["x"] for prompts, _ in loads.decoder.generate_calls)  # never decoded


def test_the_output_is_checked_before_the_model_loads(env, tmp_path, loads):
    path = _lines(tmp_path)
    res = _run(str(path), "-o", str(path))  # -o = the input: it would be replaced by the results
    assert res.exit_code == 1 and "is the input file" in res.output
    assert path.read_text().count("custom_id") == 3

    out = tmp_path / "done.jsonl"
    out.write_text("earlier results\n")
    res = _run(str(path), "-o", str(out))
    assert res.exit_code == 1 and f"{out} already exists: pass --force" in res.output
    assert out.read_text() == "earlier results\n"

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        res = _run(str(path), "-o", str(locked / "out.jsonl"))
        assert res.exit_code == 1 and "cannot write the output" in res.output
    assert loads == []

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output folder should be")
    res = _run(str(path), "-o", str(blocker / "out.jsonl"))
    assert res.exit_code == 1 and "cannot write the output" in res.output

    loads.clear()
    res = _run(str(path), "-o", str(out), "--force", "--baseline-sample", "0")
    assert res.exit_code == 0 and len(out.read_text().splitlines()) == 3 and len(loads) == 1


def test_an_output_that_cannot_be_written_at_the_end_exits_4(env, tmp_path, loads, monkeypatch):
    from spec_batch.jobs import runner

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(runner, "write_results", refuse)
    res = _run(str(_lines(tmp_path)), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == _common.EXIT_OUTPUT_NOT_WRITTEN, res.output
    assert "could not write the output file" in res.stdout


def test_a_chat_line_with_a_bad_template_fails_alone(env, tmp_path, loads):
    path = write_batch(tmp_path / "in.jsonl", [chat_line("a", "hello", max_tokens=4),
                                               chat_line("b", "BAD TEMPLATE", max_tokens=4)])
    res = _run(str(path), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == 0, res.output  # the job completed; the failed request is in the errors file
    err = json.loads((tmp_path / "out.errors.jsonl").read_text())
    assert err["response"]["body"]["error"]["message"].startswith("line 2, custom_id 'b': ")
