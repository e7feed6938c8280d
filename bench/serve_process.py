"""`spec-batch serve` as a subprocess, for bench/bench_server.py and the server tests: a free port, a SQLite file
of its own, the repository's code through PYTHONPATH, its log in a file; ready once /health answers."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from bench.processes import REPO, SPEC_BATCH, free_port


class ServeProcess:
    def __init__(self, workdir: Path, *args: str, keys: str = "", env: dict[str, str] | None = None):
        self.port = free_port()
        self.workdir = workdir
        self.args = args
        self.log_path = workdir / f"serve-{self.port}.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "SPEC_BATCH_DATABASE_URL": f"sqlite:///{workdir / f'serve-{self.port}.db'}",
            "SPEC_BATCH_API_KEYS": keys,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self, timeout: float = 180) -> ServeProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [SPEC_BATCH, "serve", "--port", str(self.port), *self.args]
        self.process = subprocess.Popen(
            cmd, env=self.env, cwd=self.workdir, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"spec-batch serve exited {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"spec-batch serve did not answer in {timeout:.0f} s:\n{self.output()}")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (graceful: in-flight requests finish) and its exit status (uvicorn exits -SIGTERM)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)
