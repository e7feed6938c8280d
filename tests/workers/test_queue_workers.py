"""The queue end to end: real Redis, real `spec-batch worker` processes with the real default model, SQLite.

Two workers (one torch thread each: two cores) serve the whole module; a test that kills one starts it again.
Jobs are small (max_tokens 8-16) so the module stays within a few minutes on two cores.
Fault tests with their own servers (Redis restarted, PostgreSQL unreachable): test_queue_faults.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from queue_testlib import WorkerProcess, run_cli, wait_for, worker_env, write_completions
from sqlalchemy import select

from spec_batch.store import chunks as qstore
from spec_batch.store import make_session_factory, migrate_to_head, queries, summaries
from spec_batch.store.models import Request

pytestmark = [pytest.mark.slow, pytest.mark.redis]

LEASE_S = 3
JOB_TIMEOUT_S = 240


@dataclass
class Fleet:
    db_url: str
    env: dict
    dir: Path
    workers: dict[str, WorkerProcess] = field(default_factory=dict)

    @property
    def factory(self):
        return make_session_factory(self.db_url)

    def ensure(self) -> None:
        """Every worker up (a test may have killed one)."""
        started = []
        for name, w in list(self.workers.items()):
            if not w.alive():
                w.stop()
                self.workers[name] = WorkerProcess(name, self.env, self.dir).start()
                started.append(self.workers[name])
        for w in started:
            w.wait_ready()

    def logs(self) -> str:
        return "\n".join(f"--- worker {n} ---\n{w.log_tail(40)}" for n, w in self.workers.items())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    d = tmp_path_factory.mktemp("fleet")
    db_url = f"sqlite:///{d / 'queue.db'}"
    migrate_to_head(db_url)
    env = worker_env(db_url, redis_url, lease_seconds=LEASE_S, SPEC_BATCH_ADAPTIVE="0")
    f = Fleet(db_url, env, d)
    for name in ("a", "b"):
        f.workers[name] = WorkerProcess(name, env, d).start()
    try:
        for w in f.workers.values():
            w.wait_ready()
        yield f
    finally:
        for w in f.workers.values():
            w.stop()


@pytest.fixture
def live(fleet):
    """The fleet with both workers up; their logs are printed (shown by pytest when the test fails)."""
    fleet.ensure()
    yield fleet
    print(fleet.logs())


def submit(fleet: Fleet, path: Path, *args: str) -> str:
    proc = run_cli("submit", str(path), "--baseline-sample", "0", *args, env=fleet.env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1]
    assert job_id.startswith("job_"), proc.stdout
    return job_id


def wait_job(fleet: Fleet, job_id: str, timeout: float = JOB_TIMEOUT_S) -> str:
    def ended():
        with fleet.factory() as s:
            status = queries.get_job(s, job_id).status
        return status if status in ("completed", "failed", "cancelled") else None

    try:
        return wait_for(ended, timeout, 0.25, what=f"job {job_id} to end")
    except AssertionError:
        print(fleet.logs())
        raise


def rows(fleet: Fleet, job_id: str) -> list[Request]:
    with fleet.factory() as s:
        return list(s.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.line_number)))


def assert_all_done_once(fleet: Fleet, job_id: str, n: int, failed: set[str] = frozenset()) -> list[Request]:
    rs = rows(fleet, job_id)
    assert len(rs) == n and len({r.custom_id for r in rs}) == n
    for r in rs:
        want = "failed" if r.custom_id in failed else "completed"
        assert r.status == want, (r.custom_id, r.status, r.error)
        assert r.completed_at is not None and r.lease_expires_at is None
        if want == "completed":
            assert r.output is not None and r.output_tokens and r.finish_reason in ("stop", "length")
    with fleet.factory() as s:
        job = queries.get_job(s, job_id)
        assert job.completed_at is not None and job.status == "completed"
        assert {c.state for c in qstore.job_chunks(s, job_id)} <= {"done", "split"}
    return rs


def pid_of(token: str | None) -> int | None:
    try:
        return int(token.split("/")[-2]) if token else None
    except (ValueError, IndexError):
        return None


# ---------------------------------------------------------------- tests


def test_submit_and_wait_through_a_worker_matches_the_in_process_runner(live, tmp_path):
    """`spec-batch submit` + `spec-batch wait` through real workers; the same file in-process gives the same
    per-job statistics and outputs. (Both sides draft a fixed 8 tokens, SPEC_BATCH_ADAPTIVE=0: the adaptive
    policy times forward passes, so its draft lengths, and the acceptance statistics, vary from run to run.)"""
    from spec_batch import load_decoder
    from spec_batch.jobs import create_job_from_file, run_job

    path = write_completions(tmp_path / "b.jsonl", 6, max_tokens=8)
    job_id = submit(live, path, "--chunk-size", "3", "--batch-size", "4", "--max-tokens", "8")
    out = tmp_path / "results.jsonl"
    proc = run_cli(
        "wait",
        job_id,
        "--timeout",
        str(JOB_TIMEOUT_S),
        "--interval",
        "0.5",
        "-o",
        str(out),
        env=live.env,
        timeout=JOB_TIMEOUT_S + 60,
    )
    assert proc.returncode == 0, proc.stderr + live.logs()
    assert proc.stdout.strip().splitlines()[-1] == "completed"
    assert "6/6 done" in proc.stderr
    assert len(out.read_text().splitlines()) == 6
    assert_all_done_once(live, job_id, 6)

    # the same input in-process (same batch size, no baseline on either side)
    factory = live.factory
    local_id, _ = create_job_from_file(
        factory,
        path,
        target="default",
        drafter="ngram",
        batch_size=4,
        baseline_sample=0,
        sampling_defaults={"max_new_tokens": 8},
    )
    run_job(factory, local_id, load_decoder("default", "ngram", num_draft_tokens=8, adaptive=False))
    with factory() as s:
        q = summaries.job_summary_row(s, job_id)
        local = summaries.job_summary_row(s, local_id)
    for key in ("n_requests", "n_completed", "n_failed", "output_tokens"):
        assert q[key] == local[key], key
    for key in ("acceptance_rate", "tokens_per_step"):
        assert q[key] == pytest.approx(local[key], rel=1e-9), key
    by_id = {r.custom_id: r for r in rows(live, local_id)}
    for r in rows(live, job_id):
        l = by_id[r.custom_id]
        assert (r.output, r.output_tokens, r.draft_tokens, r.accepted_tokens, r.target_forwards) == (
            l.output,
            l.output_tokens,
            l.draft_tokens,
            l.accepted_tokens,
            l.target_forwards,
        )


def test_two_workers_share_one_job(live, tmp_path):
    path = write_completions(tmp_path / "b.jsonl", 8, max_tokens=8)
    job_id = submit(live, path, "--chunk-size", "2", "--batch-size", "2", "--max-tokens", "8")
    assert wait_job(live, job_id) == "completed"
    rs = assert_all_done_once(live, job_id, 8)
    pids = {pid_of(r.worker) for r in rs}
    worker_pids = {pid for w in live.workers.values() for pid in w.children()}
    assert pids <= worker_pids and len(pids) == 2, (pids, worker_pids)
    with live.factory() as s:
        job = queries.get_job(s, job_id)
        chunks = qstore.job_chunks(s, job_id)
    assert job.status == "completed" and len(chunks) == 4 and all(c.attempts == 1 for c in chunks)


def test_a_failing_request_fails_alone(live, tmp_path):
    path = write_completions(tmp_path / "b.jsonl", 4, max_tokens=8, failing=(2,))
    job_id = submit(live, path, "--chunk-size", "4", "--batch-size", "4")
    assert wait_job(live, job_id) == "completed"
    rs = assert_all_done_once(live, job_id, 4, failed={"r2"})
    bad = next(r for r in rs if r.custom_id == "r2")
    assert "context" in bad.error and bad.error_code


def test_cancel_a_running_job(live, tmp_path):
    path = write_completions(tmp_path / "b.jsonl", 16, max_tokens=16)
    job_id = submit(live, path, "--chunk-size", "2", "--batch-size", "1", "--max-tokens", "16")

    def some_done():
        with live.factory() as s:
            c = queries.job_counts(s, job_id)
        return c["completed"] >= 1 and c["running"] >= 1

    wait_for(some_done, JOB_TIMEOUT_S, 0.1, what="a request completed while others run")
    proc = run_cli("cancel", job_id, "--wait", env=live.env, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert wait_job(live, job_id) == "cancelled"
    with live.factory() as s:
        counts = queries.job_counts(s, job_id)
        job = queries.get_job(s, job_id)
        chunks = qstore.job_chunks(s, job_id)
    assert counts["pending"] == counts["running"] == 0
    assert counts["completed"] + counts["failed"] + counts["cancelled"] == 16
    assert 1 <= counts["completed"] < 16 and counts["cancelled"] >= 1
    assert job.cancelled_at is not None and job.completed_at is None
    assert all(c.state == "done" for c in chunks)
    # the workers are free again: a new job runs
    path2 = write_completions(tmp_path / "c.jsonl", 2, max_tokens=4)
    assert wait_job(live, submit(live, path2, "--max-tokens", "4")) == "completed"


MIDDLE_TOKENS = 48  # a request's tokens where a test kills a worker in the middle of a chunk


def _chunk_in_flight(fleet: Fleet, job_id: str, worker: WorkerProcess):
    """A chunk of `worker` with at least one request done and one still open (the middle of a chunk)."""
    kids = set(worker.children())
    with fleet.factory() as s:
        for c in qstore.job_chunks(s, job_id, [qstore.CHUNK_RUNNING]):
            if pid_of(c.worker) not in kids:
                continue
            statuses = s.scalars(select(Request.status).where(Request.id.in_(c.request_ids))).all()
            if "completed" in statuses and any(x in ("running", "pending") for x in statuses):
                return c.id, c.worker
    return None


def test_kill_9_a_worker_in_the_middle_of_a_chunk(live, tmp_path):
    # 48 tokens a request: the middle of a chunk lasts seconds even on a fast CPU (at 16 a quiet Zen 5 ran a
    # request in 0.6 s, and a loaded test process's polls missed the window)
    path = write_completions(tmp_path / "b.jsonl", 8, max_tokens=MIDDLE_TOKENS)
    job_id = submit(live, path, "--chunk-size", "4", "--batch-size", "1", "--max-tokens", str(MIDDLE_TOKENS))
    victim = live.workers["a"]
    chunk_id, holder = wait_for(
        lambda: _chunk_in_flight(live, job_id, victim), JOB_TIMEOUT_S, 0.05, what="worker a in the middle of a chunk"
    )
    done_before = {r.id: (r.output, r.worker) for r in rows(live, job_id) if r.status == "completed"}
    victim.kill9()  # the main process and its pool child: a lost machine
    t_kill = time.monotonic()
    assert wait_job(live, job_id) == "completed"
    rs = assert_all_done_once(live, job_id, 8)
    # what was stored before the kill was kept, not redone
    for r in rs:
        if r.id in done_before:
            assert (r.output, r.worker) == done_before[r.id]
    with live.factory() as s:
        chunk = qstore.get_chunk(s, chunk_id)
    assert chunk.attempts == 2 and chunk.worker != holder and chunk.state == "done"
    taken_over = [r for r in rs if r.id in chunk.request_ids and r.id not in done_before]
    assert taken_over and all(r.worker == chunk.worker and r.attempts >= 1 for r in taken_over)
    assert time.monotonic() - t_kill < JOB_TIMEOUT_S


def test_kill_only_the_pool_child(live, tmp_path):
    path = write_completions(tmp_path / "b.jsonl", 4, max_tokens=MIDDLE_TOKENS)
    # one chunk, so it is worker a's or b's; kill the child of whichever holds it
    job_id = submit(live, path, "--chunk-size", "4", "--batch-size", "1", "--max-tokens", str(MIDDLE_TOKENS))

    def in_flight():
        for w in live.workers.values():
            got = _chunk_in_flight(live, job_id, w)
            if got:
                return w, got
        return None

    worker, (chunk_id, holder) = wait_for(in_flight, JOB_TIMEOUT_S, 0.05, what="a chunk in flight")
    child = worker.kill_child()
    assert pid_of(holder) == child
    assert wait_job(live, job_id) == "completed"
    assert_all_done_once(live, job_id, 4)
    assert worker.alive()  # the main process stayed and forked a new child
    with live.factory() as s:
        chunk = qstore.get_chunk(s, chunk_id)
    assert chunk.attempts == 2 and pid_of(chunk.worker) != child


def test_worker_loads_its_model_once(live):
    for w in live.workers.values():
        loads = [ln for ln in w.log().splitlines() if "loaded default + ngram" in ln]
        # one load per pool child that ever ran a task (a killed child's replacement loads again)
        pids = {ln.rsplit("pid ", 1)[-1].rstrip(")") for ln in loads}
        assert len(loads) == len(pids), loads


def test_results_are_openai_lines(live, tmp_path):
    path = write_completions(tmp_path / "b.jsonl", 2, max_tokens=4)
    job_id = submit(live, path, "--max-tokens", "4")
    assert wait_job(live, job_id) == "completed"
    out = tmp_path / "r.jsonl"
    proc = run_cli("results", job_id, "-o", str(out), env=live.env)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1"]
