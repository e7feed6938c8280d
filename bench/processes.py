"""Real processes for the worker tests and bench/bench_queue.py: a private Redis server and `spec-batch worker`.

- ``RedisServer``: a private ``redis-server`` on a free port (no persistence), restartable; each user gets its own
  broker, so it never collides with another run or with data in the shared Redis at 6379.
- ``WorkerProcess``: ``spec-batch worker`` as a subprocess in its own process group (so a test can SIGKILL
  the whole worker, or only its pool child), with its log in a file; stopped at teardown.
- ``worker_env(db_url, broker_url, lease_seconds)``: the environment of a worker (one torch thread each).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC_BATCH = str(Path(sys.executable).with_name("spec-batch"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_ping(url: str, timeout: float = 1.0) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except Exception:
        return False


class RedisServer:
    """A private redis-server (no persistence: a restart loses every message, which the fault tests need)."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.port = port or free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--logfile",
                str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(lambda: redis_ping(self.url, 0.2), timeout, what=f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        if down_s:
            time.sleep(down_s)
        self.start()


def wait_for(cond: Callable[[], object], timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def caller_env() -> dict[str, str]:
    """This process's environment without its SPEC_BATCH_* settings but the cache and the weights (the tests pin
    weights to full, to compare a child's outputs with the Python API's)."""
    kept = ("SPEC_BATCH_CACHE", "SPEC_BATCH_WEIGHTS")
    return {k: v for k, v in os.environ.items() if not k.startswith("SPEC_BATCH_") or k in kept}


def worker_env(db_url: str, broker_url: str, lease_seconds: int = 3, **extra: str) -> dict[str, str]:
    env = caller_env()
    env.update(
        SPEC_BATCH_DATABASE_URL=db_url,
        SPEC_BATCH_BROKER_URL=broker_url,
        SPEC_BATCH_LEASE_SECONDS=str(lease_seconds),
        SPEC_BATCH_TORCH_THREADS="1",  # two workers on two cores
        # the n-gram drafter: a request's statistics do not depend on which worker (and its job memory) ran it
        SPEC_BATCH_DEFAULT_DRAFT="ngram",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class WorkerProcess:
    """`spec-batch worker` in its own process group."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, *args: str):
        self.name = name
        self.env = env
        self.log_path = log_dir / f"worker-{name}.log"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._log_start = 0

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed by stop())
        self._log_start = self._log.tell()  # wait_ready looks at this run's lines only
        self.proc = subprocess.Popen(
            [SPEC_BATCH, "worker", "-n", f"{self.name}@%h", "-c", "1", "-l", "INFO", *self.args],
            cwd=str(REPO),
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, timeout: float = 120.0) -> WorkerProcess:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with open(self.log_path, "rb") as fh:
                    fh.seek(self._log_start)
                    return b" ready." in fh.read()
            except OSError:
                return False

        wait_for(ready, timeout, 0.2, what=f"worker {self.name} to be ready")
        return self

    def children(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL to the main process and its children (the whole process group): a lost machine."""
        os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def kill_child(self) -> int:
        """SIGKILL to the pool child only (out of memory, a segfault); returns its pid."""
        kids = self.children()
        assert kids, f"worker {self.name} has no pool child"
        os.kill(kids[0], signal.SIGKILL)
        return kids[0]

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # leftovers of the group (an orphaned pool child)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
