"""A real `spec-batch serve` process for the online tests: the default model with the n-gram drafter, on a free
port, a SQLite file of its own and one API key (KEY); the worktree's code through PYTHONPATH."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

SPEC_BATCH = str(Path(sys.executable).with_name("spec-batch"))
ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-online-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)


def start_server(tmp: Path, *args: str, keys: str = KEY, timeout: float = 180) -> Server:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SPEC_BATCH_DATABASE_URL": f"sqlite:///{tmp / 'serve.db'}", "SPEC_BATCH_API_KEYS": keys,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = tmp / f"serve-{port}.log"
    cmd = [SPEC_BATCH, "serve", "--port", str(port), "--target", "default", "--draft", "ngram", *args]
    process = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log.open("w"), stderr=subprocess.STDOUT)
    server = Server(process, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"spec-batch serve exited {process.returncode}:\n{server.output()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"spec-batch serve did not answer in {timeout} s:\n{server.output()}")
