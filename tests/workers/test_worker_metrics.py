"""workers/metrics.py in multiprocess mode, in a fresh interpreter (the mode is chosen when prometheus_client is
first imported): pool-like forked children count, the main process serves the sum, dead children's live gauge
goes away, and importing prometheus_client too early is refused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, time, urllib.request
    from types import SimpleNamespace
    from spec_batch.workers import metrics

    port = int(sys.argv[1])
    path = metrics.prepare()
    ctx = multiprocessing.get_context("fork")  # as Celery's prefork pool

    def child(i, go_on):
        stats = SimpleNamespace(output_tokens=10 + i, draft_tokens=8, accepted_tokens=5, target_forwards=4,
                                accepted_per_position=[3, 2], wall_s=0.5)
        chunk = metrics.ChunkMetrics(target="t", drafter="d", n=4)
        chunk.on_stored("completed", stats)
        chunk.on_stored("failed", None)  # 2 left in progress
        if i == 2:
            metrics.process_exited()  # a child that shuts down cleanly
            return
        if i == 1:
            os._exit(0)  # a child that dies without shutting down
        go_on.wait(20)

    go_on = ctx.Event()
    children = [ctx.Process(target=child, args=(i, go_on)) for i in range(3)]
    for c in children:
        c.start()
    children[2].join()
    time.sleep(0.5)
    metrics.serve(port, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    go_on.set()
    for c in children:
        c.join()
    samples = {}
    for line in text.splitlines():
        if line.startswith("spec_batch_") and "_bucket" not in line and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    metrics.shutdown()
    print(json.dumps({"samples": samples, "dir_removed": not os.path.exists(path)}))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )


def test_children_add_up_in_the_main_process(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    proc = _run(SCRIPT, str(_free_port()))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    s = result["samples"]
    lab = 'drafter="d",target="t"'
    assert s['spec_batch_requests_total{drafter="d",status="completed",target="t"}'] == 3
    assert s['spec_batch_requests_total{drafter="d",status="failed",target="t"}'] == 3
    assert s[f"spec_batch_output_tokens_total{{{lab}}}"] == 10 + 11 + 12
    assert s[f"spec_batch_draft_tokens_total{{{lab}}}"] == 24
    assert s[f"spec_batch_accepted_tokens_total{{{lab}}}"] == 15
    assert s[f"spec_batch_target_forwards_total{{{lab}}}"] == 12
    assert s['spec_batch_accepted_tokens_per_position_total{drafter="d",position="1",target="t"}'] == 9
    assert s['spec_batch_accepted_tokens_per_position_total{drafter="d",position="2",target="t"}'] == 6
    assert s[f"spec_batch_request_latency_seconds_count{{{lab}}}"] == 3
    assert s[f"spec_batch_request_latency_seconds_sum{{{lab}}}"] == 1.5
    assert s[f"spec_batch_step_seconds_sum{{{lab}}}"] == 3 * 0.125
    # 2 in progress per child; only child 0 is alive (child 1 died, child 2 shut down)
    assert s[f"spec_batch_requests_in_progress{{{lab}}}"] == 2
    assert result["dir_removed"]


def test_prometheus_client_imported_first_is_refused(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    proc = _run("import prometheus_client\nfrom spec_batch.workers import metrics\nmetrics.prepare()")
    assert proc.returncode != 0 and "imported before the worker set PROMETHEUS_MULTIPROC_DIR" in proc.stderr


def test_a_given_directory_is_emptied_and_kept(tmp_path, monkeypatch):
    stale = tmp_path / "counter_999.db"
    stale.write_bytes(b"old")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    proc = _run("from spec_batch.workers import metrics\nprint(metrics.prepare())\nmetrics.shutdown()")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path) and not stale.exists() and tmp_path.is_dir()


def listening_address(port: int, pid: int | str = "self") -> str | None:
    """The local IPv4 address a TCP socket of process pid listens on at port (from /proc), or None."""
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        host, hex_port = fields[1].split(":")
        if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            return socket.inet_ntoa(bytes.fromhex(host)[::-1])
    return None


SERVE = textwrap.dedent(
    """
    import sys, time
    from spec_batch.workers import metrics

    metrics.prepare()
    metrics.serve(int(sys.argv[1]))  # as the worker does: no address given
    time.sleep(0.3)
    print("serving")
    sys.stdout.flush()
    time.sleep(float(sys.argv[2]))
    metrics.shutdown()
    """
)


@pytest.mark.parametrize("host, expected", [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_metrics_listen_on_this_machine_only_unless_told(monkeypatch, host, expected):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    if host is None:
        monkeypatch.delenv("SPEC_BATCH_METRICS_HOST", raising=False)
    else:
        monkeypatch.setenv("SPEC_BATCH_METRICS_HOST", host)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port), "10"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "serving"
        assert listening_address(port, proc.pid) == expected
    finally:
        proc.kill()
        proc.wait()
