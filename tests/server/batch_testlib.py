"""Helpers of the Files and Batches tests: a real API server process (tests/server/batch_server.py under uvicorn),
the official `openai` client on it, batch files, and polling a batch until it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.processes import caller_env, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
SERVER = str(Path(__file__).with_name("batch_server.py"))
ENDED = ("completed", "failed", "cancelled", "expired")


def api_env(**extra: str) -> dict[str, str]:
    """The server's environment: this checkout first on PYTHONPATH, the caller's environment (bench.processes)."""
    env = caller_env()
    env.update(
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        SPEC_BATCH_TORCH_THREADS="1",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


class ApiServer:
    """tests/server/batch_server.py as a subprocess (own process group), its log in a file."""

    def __init__(self, db_url: str, log_dir: Path, env: dict[str, str], *args: str) -> None:
        self.db_url, self.env, self.args = db_url, env, args
        self.port = free_port()
        self.log_path = log_dir / f"api-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def repo() -> Path:
        return REPO

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 180.0) -> ApiServer:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the server process holds it)
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--db", self.db_url, "--port", str(self.port), *self.args],
            cwd=str(REPO),
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._ready, timeout, 0.2, what=f"the API server on port {self.port}")
        return self

    def _ready(self) -> bool:
        import httpx

        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the API server exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def client(self, key: str | None = "key-a"):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=key or "none", max_retries=0, timeout=60)


def run_cli(*args: str, env: dict[str, str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`spec-batch ARGS` of this checkout (PYTHONPATH in env)."""
    return subprocess.run(
        [sys.executable, "-c", "from spec_batch.cli import main; main()", *args],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def chat_line(cid: str, content: str, max_tokens: int = 8, **body) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                **body,
            },
        }
    )


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def wait_batch(client, batch_id: str, timeout: float = 300.0, until: tuple[str, ...] = ENDED):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout:.0f}s")
        time.sleep(0.5)


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
