"""The output guard of every command that writes a file (`run`, `results`, `wait -o`, `report`): a job's own
files, devices, FIFOs and folders are never replaced, --force or not; an existing file needs --force; and all of
it is checked before the model loads (the model here is the fake decoder)."""

from __future__ import annotations

import os
import stat

import pytest
from batch_lines import completion_line, write_batch
from click.testing import CliRunner

from spec_batch.cli import jobs as cli_jobs
from spec_batch.cli import main


@pytest.fixture
def env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    return url


@pytest.fixture
def loads(monkeypatch, fake_decoder_cls):
    """The decoders `run` loaded (the fake one)."""
    calls: list[tuple[str, str]] = []

    def load(target, draft, device, dtype, *precision):  # precision: --weights, --draft-weights
        calls.append((target, draft))
        return fake_decoder_cls()

    monkeypatch.setattr(cli_jobs, "_load_decoder", load)
    return calls


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _input(tmp_path, name: str = "in.jsonl"):
    return write_batch(
        tmp_path / name, [completion_line(f"r{i}", f"prompt {i}", max_tokens=4) for i in range(3)] + ["{not json"]
    )  # one invalid line: the job has an errors file


@pytest.fixture
def finished_job(env, tmp_path, loads):
    """A job run to the end by `run`: its input, results and errors files."""
    src = _input(tmp_path)
    out = tmp_path / "out.jsonl"
    res = _cli("run", str(src), "-o", str(out), "--baseline-sample", "0")
    assert res.exit_code == 0, res.output
    loads.clear()
    return res.stdout.splitlines()[0], src, out, tmp_path / "out.errors.jsonl"


def test_report_never_replaces_a_jobs_files(finished_job):
    job_id, src, out, errors = finished_job
    before = {p: p.read_bytes() for p in (src, out, errors)}
    for target in (src, out, errors):
        for force in ((), ("--force",)):
            res = _cli("report", job_id, "-o", str(target), *force)
            assert res.exit_code == 1, res.output
            assert f"{target} is the " in res.output and f"file of job {job_id}" in res.output
    res = _cli("report", "--history", "-o", str(src), "--force")
    assert res.exit_code == 1 and "input file of job" in res.output
    assert {p: p.read_bytes() for p in before} == before


def test_report_needs_force_to_replace_a_file(finished_job, tmp_path):
    job_id = finished_job[0]
    page = tmp_path / "page.html"
    page.write_text("an earlier page")
    res = _cli("report", job_id, "-o", str(page))
    assert res.exit_code == 1 and f"{page} already exists: pass --force" in res.output
    assert page.read_text() == "an earlier page"
    res = _cli("report", job_id, "-o", str(page), "--force")
    assert res.exit_code == 0, res.output
    assert page.read_text(encoding="utf-8").lstrip().startswith("<!")


def test_results_and_wait_never_write_over_the_jobs_errors_file(finished_job):
    job_id, _, _, errors = finished_job
    before = errors.read_bytes()
    for command in (("results", job_id), ("wait", job_id, "-q")):
        res = _cli(*command, "-o", str(errors), "--force")
        assert res.exit_code == 1 and f"is the errors file of job {job_id}" in res.output, res.output
    assert errors.read_bytes() == before


def test_results_may_rewrite_the_jobs_own_output_with_force(finished_job):
    job_id, _, out, errors = finished_job
    res = _cli("results", job_id, "-o", str(out), "--force")
    assert res.exit_code == 0, res.output
    assert len(out.read_text().splitlines()) == 3 and len(errors.read_text().splitlines()) == 1


def private_device(tmp_path):
    """A character device node like /dev/full (1, 7) in tmp_path: a test must never risk the machine's own (a
    failing run of old code, as root, replaced /dev/full with a regular file). Skips without CAP_MKNOD."""
    node = tmp_path / "full.jsonl"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return node


@pytest.mark.parametrize("kind", ["fifo", "device", "folder-errors"])
def test_run_never_replaces_what_is_not_a_regular_file(env, tmp_path, loads, kind):
    src = _input(tmp_path)
    if kind == "fifo":
        target = tmp_path / "pipe.jsonl"
        os.mkfifo(target)
        checked, what = target, "a FIFO"
    elif kind == "device":  # what `run -o /dev/full --force` did as root: a regular file over the device
        target = checked = private_device(tmp_path)
        what = "a character device"
    else:  # OUT.errors.jsonl is a folder
        target = tmp_path / "res.jsonl"
        checked = tmp_path / "res.errors.jsonl"
        checked.mkdir()
        what = "a folder"
    res = _cli("run", str(src), "-o", str(target), "--force")
    assert res.exit_code == 1, res.output
    assert f"{checked} is {what}" in res.output
    assert loads == []  # refused before the model loaded
    if kind == "fifo":
        assert stat.S_ISFIFO(os.stat(target).st_mode)
    if kind == "device":
        assert stat.S_ISCHR(os.stat(target).st_mode)


def test_wait_and_report_refuse_a_fifo_before_anything_else(finished_job, tmp_path):
    job_id = finished_job[0]
    pipe = tmp_path / "pipe.html"
    os.mkfifo(pipe)
    for command in (("wait", job_id, "-q"), ("report", job_id)):
        res = _cli(*command, "-o", str(pipe), "--force")
        assert res.exit_code == 1 and "is a FIFO" in res.output, res.output
        assert stat.S_ISFIFO(os.stat(pipe).st_mode)


def test_a_folder_as_o_is_refused_with_exit_1(finished_job, tmp_path):
    """docs/jobs.md: an output refused exits 1 (not click's usage error, 2), for every command that writes."""
    job_id, src = finished_job[0], finished_job[1]
    folder = tmp_path / "a-folder"
    folder.mkdir()
    commands = [("run", str(src)), ("results", job_id), ("wait", job_id, "-q"), ("report", job_id)]
    for command in commands:
        res = _cli(*command, "-o", str(folder), "--force")
        assert res.exit_code == 1, (command, res.output)
        assert f"{folder} is a folder" in res.output, res.output
    assert folder.is_dir()


def test_the_writer_itself_refuses_a_device(finished_job, tmp_path):
    """A worker finalizing a job writes through the same writer: it refuses too (the job records why)."""
    from spec_batch.jobs import write_results
    from spec_batch.store import make_session_factory

    job_id = finished_job[0]
    device = private_device(tmp_path)
    factory = make_session_factory(os.environ["SPEC_BATCH_DATABASE_URL"])
    with pytest.raises(OSError, match="character device, not a regular file"):
        write_results(factory, job_id, device)
    assert stat.S_ISCHR(os.stat(device).st_mode)
