"""The soak test's records (bench/soak_server.py): the ledger of every request the clients made, and the server's
resources sampled once a window (RSS, open file descriptors, threads, database connections), summed up a window
at a time into the per-minute table.

Database connections: on PostgreSQL the rows of ``pg_stat_activity`` for the soak's database, less the monitor's own
connection (one connection, kept open for the whole run); on SQLite the server's open file descriptors on the
database file and its ``-wal`` / ``-shm`` / ``-journal`` companions.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Record:
    """One request as its client saw it. outcome: complete (one whole, well-formed answer, or the expected error of
    a bad request), cancelled (the client went away on purpose), error (anything else: `detail` says what)."""

    kind: str
    started: float
    ended: float
    outcome: str
    tokens: int = 0
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.ended - self.started


class Ledger:
    """Every request's Record, from every client thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[Record] = []

    def add(self, record: Record) -> None:
        with self._lock:
            self._records.append(record)

    def all(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def ended_between(self, t0: float, t1: float) -> list[Record]:
        return [r for r in self.all() if t0 <= r.ended < t1]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# ---------------------------------------------------------------- the server's resources


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fd_targets(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed between listdir and readlink
            continue
    return targets


class DbConnections:
    """Counts the server's database connections (see the module docstring)."""

    def __init__(self, db_url: str, pid: int) -> None:
        from sqlalchemy.engine import make_url

        self.url = make_url(db_url)
        self.pid = pid
        self._pg = None
        if self.url.get_backend_name() == "postgresql":
            import psycopg

            plain = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
            self._pg = psycopg.connect(plain, autocommit=True, connect_timeout=5)

    def count(self) -> dict[str, int]:
        if self._pg is not None:
            rows = self._pg.execute(
                "SELECT coalesce(state, '?'), count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() GROUP BY 1"
            ).fetchall()
            by_state = {state: int(n) for state, n in rows}
            return {"total": sum(by_state.values()), "idle_in_transaction": by_state.get("idle in transaction", 0)}
        db = str(Path(self.url.database or "").resolve())
        handles = [t for t in fd_targets(self.pid) if t == db or t.startswith(db + "-")]
        return {"total": len(handles), "idle_in_transaction": 0}

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()


@dataclass
class Minute:
    """One window of the table: the server's resources at its end, and the requests that ended in it."""

    minute: float
    rss_mb: float
    fds: int
    threads: int
    db_connections: int
    db_idle_in_transaction: int
    done: int
    answers: int
    cancelled: int
    errors: int
    p50_s: float
    p95_s: float
    tokens_per_s: float
    batches_done: int
    error_details: list[str] = field(default_factory=list)


def summarize(ledger: Ledger, t0: float, t1: float, start: float, pid: int, db: DbConnections) -> Minute:
    records = ledger.ended_between(t0, t1)
    online = [r for r in records if r.outcome == "complete" and r.kind in ("stream", "tools", "json_schema")]
    conns = db.count()
    return Minute(
        minute=round((t1 - start) / 60, 2),
        rss_mb=round(rss_mb(pid), 1),
        fds=len(fd_targets(pid)),
        threads=threads(pid),
        db_connections=conns["total"],
        db_idle_in_transaction=conns["idle_in_transaction"],
        done=sum(r.outcome == "complete" for r in records),
        answers=len(online),
        cancelled=sum(r.outcome == "cancelled" for r in records),
        errors=sum(r.outcome == "error" for r in records),
        p50_s=round(quantile([r.latency for r in online], 0.5), 2),
        p95_s=round(quantile([r.latency for r in online], 0.95), 2),
        tokens_per_s=round(sum(r.tokens for r in records if r.outcome == "complete") / max(t1 - t0, 1e-9), 1),
        batches_done=sum(r.kind == "batch" for r in records),
        error_details=[f"{r.kind}: {r.detail}" for r in records if r.outcome == "error"][:5],
    )


class Sampler(threading.Thread):
    """Closes a window every `interval` seconds until `stop` is set; `minutes` holds them in order."""

    def __init__(self, ledger: Ledger, pid: int, db: DbConnections, interval: float, start: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.ledger, self.pid, self.db, self.interval, self.start_at = ledger, pid, db, interval, start
        self.stop = threading.Event()
        self.minutes: list[Minute] = []
        self._last = start

    def close_window(self) -> Minute:
        now = time.monotonic()
        minute = summarize(self.ledger, self._last, now, self.start_at, self.pid, self.db)
        self._last = now
        self.minutes.append(minute)
        print(table_row(minute), flush=True)
        return minute

    def run(self) -> None:
        while not self.stop.wait(max(0.0, self._last + self.interval - time.monotonic())):
            self.close_window()


HEADER = (
    f"{'min':>6} {'RSS MB':>7} {'fds':>5} {'thr':>4} {'db':>3} {'done':>5} {'canc':>5} {'err':>4} "
    f"{'p50 s':>6} {'p95 s':>6} {'tok/s':>6} {'batch':>5}"
)


def table_row(m: Minute) -> str:
    return (
        f"{m.minute:>6.2f} {m.rss_mb:>7.1f} {m.fds:>5} {m.threads:>4} {m.db_connections:>3} {m.done:>5} "
        f"{m.cancelled:>5} {m.errors:>4} {m.p50_s:>6.2f} {m.p95_s:>6.2f} {m.tokens_per_s:>6.1f} {m.batches_done:>5}"
    )


def minute_dicts(minutes: list[Minute]) -> list[dict]:
    return [asdict(m) for m in minutes]


def latency_drift(minutes: list[Minute]) -> dict[str, float]:
    """p50/p95 of the first and the last fifth of the windows with online answers (a leak shows as a slow drift)."""
    rows = [m for m in minutes if m.answers]
    if not rows:
        return {}
    k = max(1, len(rows) // 5)
    head, tail = rows[:k], rows[-k:]
    return {
        "p50_first_s": round(statistics.median(m.p50_s for m in head), 2),
        "p50_last_s": round(statistics.median(m.p50_s for m in tail), 2),
        "p95_first_s": round(statistics.median(m.p95_s for m in head), 2),
        "p95_last_s": round(statistics.median(m.p95_s for m in tail), 2),
    }
