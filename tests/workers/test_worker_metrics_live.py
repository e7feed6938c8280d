"""Prometheus metrics of a real `spec-batch worker` (prefork pool, real Redis, the real default model): after a
job, the counters served at /metrics equal what SQL records for the same requests."""

from __future__ import annotations

import urllib.request

import pytest
from queue_testlib import WorkerProcess, completion, free_port, run_cli, wait_for, worker_env
from test_worker_metrics import listening_address

from spec_batch.store import make_session_factory, migrate_to_head, queries
from spec_batch.store.report_queries import job_report_data

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("spec_batch_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_worker_counters_equal_sql(tmp_path, redis_url):
    db_url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate_to_head(db_url)
    port = free_port()
    env = worker_env(db_url, redis_url, lease_seconds=5, SPEC_BATCH_METRICS_PORT=str(port))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    worker = WorkerProcess("metrics", env, tmp_path).start()
    try:
        worker.wait_ready()
        assert worker.children(), "a prefork worker runs its tasks in a pool child"
        wait_for(lambda: listening_address(port) is not None, 15, 0.2, what="/metrics to listen")
        assert listening_address(port) == "127.0.0.1"  # this machine only, unless SPEC_BATCH_METRICS_HOST says
        # repetitive prompts, so drafts get accepted; r5 does not fit the model's context and fails
        words = ["red blue green", "one two three four", "cat dog", "sun moon star", "up down", "a b c d", "x y"]
        lines = [
            completion(f"r{i}", "word " * 9000 if i == 5 else ", ".join([w] * 12) + ",", 16)
            for i, w in enumerate(words)
        ]
        path = tmp_path / "b.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        proc = run_cli("submit", str(path), "--chunk-size", "3", "--batch-size", "3", "--baseline-sample", "2", env=env)
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().splitlines()[-1]
        factory = make_session_factory(db_url)

        def finished() -> bool:
            with factory() as s:
                return queries.get_job(s, job_id).status == "completed"

        wait_for(finished, 300, 0.5, what=f"job {job_id}\n{worker.log_tail()}")
        with factory() as s:
            data = job_report_data(s, job_id)
        rows = data.requests
        assert data.baseline_requests == 2 and len(data.baseline) == 2  # the sample's results count too
        labels = f'drafter="{data.summary["drafter"]}",target="{data.summary["target"]}"'

        def total(name: str) -> int:
            return sum(getattr(r, name) or 0 for r in rows)

        positions = [0] * max(len(r.accepted_per_position or []) for r in rows)
        for r in rows:
            for j, n in enumerate(r.accepted_per_position or []):
                positions[j] += n
        expected = {
            f'spec_batch_requests_total{{drafter="{data.summary["drafter"]}",status="completed",'
            f'target="{data.summary["target"]}"}}': sum(r.status == "completed" for r in rows),
            f'spec_batch_requests_total{{drafter="{data.summary["drafter"]}",status="failed",'
            f'target="{data.summary["target"]}"}}': sum(r.status == "failed" for r in rows),
            f"spec_batch_output_tokens_total{{{labels}}}": total("output_tokens"),
            f"spec_batch_draft_tokens_total{{{labels}}}": total("draft_tokens"),
            f"spec_batch_accepted_tokens_total{{{labels}}}": total("accepted_tokens"),
            f"spec_batch_target_forwards_total{{{labels}}}": total("target_forwards"),
            f"spec_batch_request_latency_seconds_count{{{labels}}}": sum((r.wall_s or 0) > 0 for r in rows),
            f"spec_batch_requests_in_progress{{{labels}}}": 0,
        }
        for j, n in enumerate(positions):
            if n:
                expected[
                    f'spec_batch_accepted_tokens_per_position_total{{drafter="{data.summary["drafter"]}",'
                    f'position="{j + 1}",target="{data.summary["target"]}"}}'
                ] = n
        assert sum(r.status == "failed" for r in rows) == 1 and total("accepted_tokens") > 0
        assert positions and sum(positions) == total("accepted_tokens")

        def matches() -> dict | None:
            got = scrape(port)
            return got if all(got.get(k) == v for k, v in expected.items()) else None

        try:
            got = wait_for(matches, 15, 0.5, what="the counters to reach the SQL totals")
        except AssertionError:
            got = scrape(port)
            assert {k: got.get(k) for k in expected} == expected, worker.log_tail()
        latency_sum = got[f"spec_batch_request_latency_seconds_sum{{{labels}}}"]
        assert latency_sum == pytest.approx(sum(r.wall_s or 0 for r in rows))
    finally:
        worker.stop()
