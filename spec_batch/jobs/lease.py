"""Leases: who holds a claimed request (or queue chunk), until when, and the one heartbeat that keeps it.

A process that decodes requests claims them in SQL (``requests.status='running'``, ``worker`` = its token,
``lease_expires_at = now + lease``); a :class:`Heartbeat` thread renews the leases of every :class:`Lease` it
holds every lease/3 seconds while the process works: the lease's requests, and its queue chunk when it holds one
(a worker's chunk; the chunk taken over by another worker marks the lease ``lost``). A worker's heartbeat also
runs the worker's extra duties on each tick (``on_tick``: the reaper). A claim is taken over only when its lease
has expired, or when its holder is known to be dead (:func:`holder_is_dead`): a process of this machine (same
host and process namespace) whose pid is gone, e.g. a ``spec-batch run`` killed with SIGKILL, or an attempt this
process abandoned. In-process runs (``spec_batch.jobs.service``) and queue workers hold their claims the same way;
the runner is handed a Lease by its caller.

A token is ``host/pidns/pid/random``: the host and the pid say who holds a request; the pid namespace (Linux:
the inode of ``/proc/self/ns/pid``) makes "this pid is gone" a safe conclusion only inside one namespace (two
containers with one hostname never judge each other's processes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from ..store import chunks, request_claims
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


# Tokens this process gave up (a failed attempt that could not hand its chunk back): the process may take them.
_abandoned: set[str] = set()


def abandon(token: str) -> None:
    """This process will not renew `token` any more: its claims may be taken at once (holder_is_dead)."""
    _abandoned.add(token)


def abandoned_tokens() -> frozenset[str]:
    return frozenset(_abandoned)


def forget_abandoned(token: str) -> None:
    _abandoned.discard(token)


def holder_is_dead(token: str | None) -> bool:
    """True when `token` names a process of this machine and pid namespace that is gone, or an attempt this
    process abandoned. Unknown (another machine, another namespace, an unparsable token) is never dead: its
    lease decides."""
    if not token:
        return False
    if token in _abandoned:
        return True
    if PID_NAMESPACE == "-" or not token.startswith(holder_prefix()):
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
        for token, n, until in request_claims.request_holders(s, job_id):
            expired = until is None or until < now
            if expired or holder_is_dead(token):
                request_claims.release_holder(s, token, job_id=job_id)
            else:
                live.append(Holder(token, n, until))
    return live


# ---------------------------------------------------------------- leases and the heartbeat

MIN_RENEWAL_S = 0.01
MAX_RENEWAL_S = 60.0


def renewal_interval(lease_seconds: float) -> float:
    """How often a heartbeat renews: a third of the lease (so two renewals may fail in a row), within bounds."""
    return min(max(float(lease_seconds) / 3.0, MIN_RENEWAL_S), MAX_RENEWAL_S)


@dataclass
class Lease:
    """One holder's claims: requests claimed with `token` (and the queue chunk `chunk_id`, when it holds one),
    each until now + `seconds`. `lost` is set by the heartbeat when another worker took the chunk over."""

    token: str
    seconds: float
    chunk_id: str | None = None
    lost: bool = False


def new_lease(lease_seconds: float | None = None, *, token: str | None = None) -> Lease:
    from ..settings import get_settings

    seconds = get_settings().lease_seconds if lease_seconds is None else float(lease_seconds)
    return Lease(token or new_token(), seconds)


class Heartbeat:
    """A daemon thread that renews the leases it holds every renewal_interval(lease) seconds, then calls
    `on_tick` (a worker's reaper). A failed renewal (the database briefly away) is retried at the next tick; a
    process that dies stops renewing, and its leases expire. Use as a context manager (start, then stop and join)
    or start()/stop() for a worker's lifetime."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        lease_seconds: float,
        on_tick: Callable[[], None] | None = None,
        interval: float | None = None,
    ) -> None:
        self.session_factory = session_factory
        self.lease_seconds = float(lease_seconds)
        self.interval = interval if interval is not None else renewal_interval(self.lease_seconds)
        self.on_tick = on_tick
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.last_ok: float | None = None
        self._warned = 0.0

    # -- what it holds

    def hold(self, token: str, chunk_id: str | None = None) -> Lease:
        lease = Lease(token, self.lease_seconds, chunk_id)
        with self._lock:
            self._leases[token] = lease
        return lease

    def new_lease(self) -> Lease:
        return self.hold(new_token())

    def drop(self, token: str) -> None:
        with self._lock:
            self._leases.pop(token, None)

    # -- the thread

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spec-batch-heartbeat", daemon=True)
            self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._pid == os.getpid()

    def stop(self, join: bool = False) -> None:
        self._stop.set()
        self._wake.set()
        if join and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def poke(self) -> None:
        """Run a tick now (e.g. after giving a chunk up, so it is re-queued without waiting)."""
        self._wake.set()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(join=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._wake.wait(self.interval)
            self._wake.clear()

    # -- one tick

    def tick(self) -> None:
        with self._lock:
            leases = list(self._leases.values())
        ok = True
        for lease in leases:
            try:
                self._renew(lease)
            except Exception as exc:
                ok = False
                self._warn(f"lease renewal of {lease.token} failed ({brief(exc)}); retrying")
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception as exc:
                ok = False
                self._warn(f"heartbeat duty failed ({brief(exc)}); retrying")
        if ok:
            self.last_ok = time.monotonic()

    def _renew(self, lease: Lease) -> None:
        if lease.chunk_id is None:
            with self.session_factory.begin() as s:
                request_claims.renew_holder(s, lease.token, lease.seconds)
            return
        with self.session_factory.begin() as s:
            renewed_chunks, _ = chunks.renew(s, lease.token, lease.seconds)
        if renewed_chunks == 0 and self._taken_over(lease):
            if not lease.lost:
                log.warning("chunk %s was taken over by another worker; stopping it here", lease.chunk_id)
            lease.lost = True

    def _taken_over(self, lease: Lease) -> bool:
        with self.session_factory() as s:
            chunk = chunks.get_chunk(s, lease.chunk_id)
            if chunk is not None and chunk.state == chunks.CHUNK_DONE:
                return False  # finished here
            return chunk is None or chunk.worker != lease.token or chunk.state != chunks.CHUNK_RUNNING

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._warned > 30:
            log.warning(msg)
            self._warned = now


def brief(exc: BaseException) -> str:
    """One line for a log: the exception's class and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0][:240] if text else ''}"


__all__ = [
    "HOST",
    "Heartbeat",
    "Holder",
    "Lease",
    "abandon",
    "abandoned_tokens",
    "brief",
    "describe_holder",
    "forget_abandoned",
    "holder_is_dead",
    "holder_prefix",
    "new_lease",
    "new_token",
    "pid_alive",
    "renewal_interval",
    "take_over_dead_holders",
    "token_pid",
]
