"""Leases on requests: who holds a claimed request, until when, and how a live holder keeps it.

A process that decodes requests claims them in SQL (``requests.status='running'``, ``worker`` = its token,
``lease_expires_at = now + lease``); a :class:`LeaseKeeper` thread renews the token's leases every lease/3
seconds while it works. A claim is taken over only when its lease has expired, or when its holder is known to be
dead: a process of this machine (same host and process namespace) whose pid is gone, e.g. a ``spec-batch run``
killed with SIGKILL. In-process runs (``spec_batch.jobs.service``) and queue workers (``workers/``) hold their
claims the same way.

A token is ``host/pidns/pid/random``: the host and the pid say who holds a request; the pid namespace (Linux:
the inode of ``/proc/self/ns/pid``) makes "this pid is gone" a safe conclusion only inside one namespace (two
containers with one hostname never judge each other's processes).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from ..store import queries
from ..store.models import utcnow

log = logging.getLogger("spec_batch.jobs.lease")

HOST = socket.gethostname()


def _pid_namespace() -> str:
    try:
        return f"ns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux: no liveness checks by pid (leases still expire)
        return "-"


PID_NAMESPACE = _pid_namespace()


def holder_prefix() -> str:
    """The start of the tokens of this machine's processes (of this pid namespace)."""
    return f"{HOST}/{PID_NAMESPACE}/"


def new_token() -> str:
    """A holder name for one run or chunk attempt of this process."""
    return f"{holder_prefix()}{os.getpid()}/{uuid.uuid4().hex[:8]}"


def token_pid(token: str) -> int | None:
    parts = token.split("/")
    try:
        return int(parts[-2])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """False for a process that is gone or a zombie (exited, not yet reaped by its parent, e.g. a pool)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): signal 0 answered, so it lives
        return True


def holder_is_dead(token: str | None) -> bool:
    """True when `token` names a process of this machine and pid namespace that is gone. Unknown (another
    machine, another namespace, an unparsable token) is never dead: its lease decides."""
    if not token or PID_NAMESPACE == "-" or not token.startswith(holder_prefix()):
        return False
    pid = token_pid(token)
    if pid is None or pid == os.getpid():
        return False
    return not pid_alive(pid)


def describe_holder(token: str) -> str:
    """'process 123 on host h' for a token, or the token itself when it is not one of ours."""
    parts = token.split("/")
    pid = token_pid(token)
    if len(parts) >= 4 and pid is not None:
        return f"process {pid} on {parts[0]}"
    return repr(token)


@dataclass(frozen=True)
class Holder:
    """A live holder of some of a job's requests."""

    token: str
    requests: int
    lease_expires_at: datetime | None

    def __str__(self) -> str:
        until = self.lease_expires_at.astimezone().strftime("%H:%M:%S") if self.lease_expires_at else "?"
        return f"{describe_holder(self.token)} holds {self.requests} request(s) (its lease runs until {until})"


def take_over_dead_holders(session_factory: sessionmaker[Session], job_id: str) -> list[Holder]:
    """Gives back the job's requests whose holder's lease expired or who is known dead (they go back to
    pending); returns the live holders, whose requests are left alone."""
    live = []
    with session_factory.begin() as s:
        now = utcnow()
        for token, n, until in queries.request_holders(s, job_id):
            expired = until is None or until < now
            if expired or holder_is_dead(token):
                queries.release_holder(s, token, job_id=job_id)
            else:
                live.append(Holder(token, n, until))
    return live


class LeaseKeeper:
    """Renews the leases of one holder's running requests every lease/3 seconds (at most 60), in a daemon thread,
    while its `with` block runs. A failed renewal (the database briefly away) is retried at the next tick; a
    process that dies stops renewing, and its leases expire."""

    def __init__(self, session_factory: sessionmaker[Session], token: str, lease_seconds: float) -> None:
        self.session_factory = session_factory
        self.token = token
        self.lease_seconds = float(lease_seconds)
        self.interval = min(max(self.lease_seconds / 3.0, 0.01), 60.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> int:
        with self.session_factory.begin() as s:
            return queries.renew_holder(s, self.token, self.lease_seconds)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001  (the next tick retries; the lease covers the gap)
                log.warning("lease renewal of %s failed: %s", self.token, exc)

    def __enter__(self) -> "LeaseKeeper":
        self._thread = threading.Thread(target=self._run, name="spec-batch-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


__all__ = [
    "HOST",
    "Holder",
    "LeaseKeeper",
    "describe_holder",
    "holder_is_dead",
    "holder_prefix",
    "new_token",
    "pid_alive",
    "take_over_dead_holders",
    "token_pid",
]
