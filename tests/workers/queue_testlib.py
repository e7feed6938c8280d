"""Helpers of the worker tests: Redis servers and real worker processes (bench/processes.py, shared with
bench/bench_queue.py, re-exported here), batch files and the CLI.

- ``RedisServer``: a private ``redis-server`` on a free port (no persistence), restartable; tests get their own
  broker, so they never collide with another test run or with data in the shared Redis at 6379.
- ``WorkerProcess``: ``spec-batch worker`` as a subprocess in its own process group (so a test can SIGKILL
  the whole worker, or only its pool child), with its log in a file; stopped at teardown.
- ``worker_env(db_url, broker_url, lease_seconds)``: the environment of a worker (one torch thread each).
- ``write_completions(path, n, ...)``: a batch file of n completion requests (some failing on purpose).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.processes import (  # noqa: F401  (re-exported: the worker tests use them through this module)
    RedisServer,
    WorkerProcess,
    free_port,
    redis_ping,
    wait_for,
    worker_env,
)

REPO = Path(__file__).resolve().parents[2]
SHARED_REDIS_URL = os.environ.get("SPEC_BATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
SPEC_BATCH = str(Path(sys.executable).with_name("spec-batch"))


def completion(cid: str, prompt: str, max_tokens: int) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": prompt, "max_tokens": max_tokens},
        }
    )


TOPICS = [
    "apples",
    "rivers",
    "trains",
    "clouds",
    "violins",
    "bridges",
    "lanterns",
    "glaciers",
    "maps",
    "owls",
    "kites",
    "comets",
    "gardens",
    "ladders",
    "harbors",
    "meadows",
]


def write_completions(path: Path, n: int, *, max_tokens: int = 8, failing: tuple[int, ...] = ()) -> Path:
    """n requests r0..r{n-1}; those in `failing` have a prompt longer than the default model's context."""
    lines = []
    for i in range(n):
        if i in failing:
            prompt = "word " * 9000
        else:
            prompt = f"A short list of facts about {TOPICS[i % len(TOPICS)]} number {i}: 1."
        lines.append(completion(f"r{i}", prompt, max_tokens))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_cli(*args: str, env: dict[str, str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([SPEC_BATCH, *args], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout)
