"""`spec-batch submit | worker | cancel | wait`: the commands, a broker that is down, cancelling, waiting."""

from __future__ import annotations

from batch_lines import completion_line, write_batch
from click.testing import CliRunner
from sqlalchemy import select

from spec_batch.cli import main
from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.store import Job, make_session_factory, queries, servers
from spec_batch.store.models import utcnow

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def _job(factory, tmp_path, n: int, *, queue: str | None = "spec-batch.fake.ngram") -> str:
    path = write_batch(tmp_path / "b.jsonl", [completion_line(f"r{i}", f"prompt {i}") for i in range(n)])
    job_id, _ = create_job_from_file(factory, path, target="fake", drafter="ngram", baseline_sample=0, queue=queue)
    return job_id


def test_cli_commands_exist():
    for name in ("submit", "worker", "cancel", "wait"):
        assert name in main.commands
    res = CliRunner().invoke(main, ["worker", "--help"])
    assert res.exit_code == 0 and "--concurrency" in res.output and "--queues" in res.output


def test_submit_cli_with_redis_down(tmp_path, monkeypatch):
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x")])
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPEC_BATCH_BROKER_URL", DEAD_BROKER)
    res = CliRunner().invoke(main, ["submit", str(path)])
    assert res.exit_code == 1 and "cannot reach the broker" in res.output
    with make_session_factory(url)() as s:
        assert s.scalars(select(Job)).all() == []


def test_cancel_a_job_that_has_not_started(db_url, tmp_path, monkeypatch):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, 4)
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)
    res = CliRunner().invoke(main, ["cancel", job_id])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == "cancelled"
    with factory() as s:
        assert queries.job_counts(s, job_id)["cancelled"] == 4
    res = CliRunner().invoke(main, ["cancel", job_id])  # again: says so, no error
    assert res.exit_code == 0 and res.stdout.strip() == "cancelled"


def test_cancel_a_completed_job_is_an_error(db_url, tmp_path, monkeypatch, fake_decoder):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, 2, queue=None)
    run_job(factory, job_id, fake_decoder)
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)
    res = CliRunner().invoke(main, ["cancel", job_id])
    assert res.exit_code == 1 and "completed; it cannot be cancelled" in res.output


def test_wait_reports_the_end(db_url, tmp_path, monkeypatch, fake_decoder):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, 2)
    run_job(factory, job_id, fake_decoder)
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)

    out = tmp_path / "res.jsonl"
    res = CliRunner().invoke(main, ["wait", job_id, "-o", str(out), "--interval", "0.1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == "completed"
    assert len(out.read_text().splitlines()) == 2


def test_submit_names_each_invalid_line_once(tmp_path, monkeypatch):
    from spec_batch.workers import enqueue

    published = []
    monkeypatch.setattr(enqueue, "check_broker", lambda url=None: "e1")
    monkeypatch.setattr(enqueue, "publish_chunk", lambda chunk_id, queue, broker_url=None: published.append(chunk_id))
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'q.db'}")
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x"), '{"custom_id": "b"}'])
    res = CliRunner().invoke(main, ["submit", str(path), "--no-model-check"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().startswith("job_") and len(published) == 1
    assert "  line 2: url is missing" in res.stderr and "line 2: line 2" not in res.stderr


def test_queue_names_given_by_hand_are_validated(tmp_path, monkeypatch):
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x")])
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPEC_BATCH_BROKER_URL", DEAD_BROKER)
    for args in (
        ["submit", str(path), "--no-model-check", "--queue", "../../evil queue"],
        ["submit", str(path), "--no-model-check", "--queue", ""],
        ["worker", "--queues", "fine,../evil"],
    ):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, res.output
        assert "is not allowed: use 1 to 120 characters among letters, digits and . _ : -" in res.output
    assert not (tmp_path / "cli.db").exists()  # refused before the database was opened


def test_submit_notes_when_no_running_worker_consumes_the_queue(tmp_path, monkeypatch):
    from spec_batch.workers import enqueue

    monkeypatch.setattr(enqueue, "check_broker", lambda url=None: "e1")
    monkeypatch.setattr(enqueue, "publish_chunk", lambda chunk_id, queue, broker_url=None: None)
    url = f"sqlite:///{tmp_path / 'q.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    path = write_batch(tmp_path / "b.jsonl", [completion_line("a", "x")])
    args = ["submit", str(path), "--no-model-check", "--queue", "jobs.q"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "note: no running worker consumes queue jobs.q now" in res.stderr
    factory = make_session_factory(url)
    with factory.begin() as s:  # a worker process that consumes it (workers/runtime.py writes this row)
        servers.worker_heartbeat(s, "host:1:ab", ["jobs.q"], now=utcnow())
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "no running worker" not in res.stderr
    factory.kw["bind"].dispose()
