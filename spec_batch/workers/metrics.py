"""Prometheus metrics of spec-batch workers, served at ``/metrics`` on ``SPEC_BATCH_METRICS_PORT`` (off when unset),
bound to ``SPEC_BATCH_METRICS_HOST`` (default 127.0.0.1: this machine only).

Celery's prefork pool runs tasks in child processes, so the metrics use prometheus_client's multiprocess mode:
each process writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` and the worker's main process, which
serves ``/metrics``, adds them up (``MultiProcessCollector``). The order matters, and the worker's startup
follows it:

1. :func:`prepare` in the main process before the pool forks (``worker_init``): sets up the directory (a fresh
   temporary one unless ``PROMETHEUS_MULTIPROC_DIR`` is set) before prometheus_client is first imported, since
   it picks its value storage at import;
2. :func:`serve` in the main process once the pool runs (``worker_ready``);
3. :func:`process_exited` in a pool child as it shuts down (``worker_process_shutdown``); a child that was
   killed is found at the next scrape, and its live gauge dropped the same way;
4. :func:`shutdown` in the main process as the worker stops (``worker_shutdown``).

The task counts each chunk with :class:`ChunkMetrics`, whose ``on_stored`` the runner calls for every request
row it stores.

Every metric has the labels ``target`` and ``drafter``. The counters add up exactly what the store records for
the same requests (``record_request`` is called with the stats of each stored result):

- ``spec_batch_requests_total{status}``: stored results, ``completed`` or ``failed``;
- ``spec_batch_output_tokens_total``, ``spec_batch_draft_tokens_total``, ``spec_batch_accepted_tokens_total``,
  ``spec_batch_target_forwards_total``: sums of ``requests.output_tokens`` / ``draft_tokens`` /
  ``accepted_tokens`` / ``target_forwards``;
- ``spec_batch_accepted_tokens_per_position_total{position}``: ``requests.accepted_per_position``, position
  ``"1"`` being the first drafted token of a step (the list's index 0);
- ``spec_batch_request_latency_seconds`` (histogram): a request's decode time (``requests.wall_s``);
- ``spec_batch_step_seconds`` (histogram): a request's mean seconds per step (wall time / target forwards);
- ``spec_batch_requests_in_progress`` (gauge, summed over live processes): requests of the chunks in hand, not
  stored yet.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from spec_batch.jobs.lease import pid_alive

log = logging.getLogger("spec_batch.workers.metrics")

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABELS = ("target", "drafter")
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0, float("inf"))
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
_LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db$")

_created_dir: str | None = None  # a temporary directory prepare() made (removed by shutdown())


def prepare() -> str:
    """Main process, before the pool forks: the multiprocess directory, emptied of an earlier run's files.
    Returns its path. Raises RuntimeError when prometheus_client was imported before (it would keep its
    values in memory, where the serving process never sees them)."""
    global _created_dir
    path = os.environ.get(MULTIPROC_DIR_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        for stale in glob.glob(os.path.join(path, "*.db")):
            os.remove(stale)
    else:
        path = _created_dir = tempfile.mkdtemp(prefix="spec-batch-metrics-")
        os.environ[MULTIPROC_DIR_ENV] = path
    from prometheus_client import values

    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError(
            "prometheus_client was imported before the worker set PROMETHEUS_MULTIPROC_DIR; "
            "set PROMETHEUS_MULTIPROC_DIR in the worker's environment before it starts"
        )
    return path


def serve(port: int, addr: str | None = None) -> None:
    """Main process: serves the sum over all worker processes at http://addr:port/metrics (a daemon thread).
    addr None: SPEC_BATCH_METRICS_HOST, by default 127.0.0.1 (this machine only: the counters name models and
    volumes; a deployment whose Prometheus scrapes over the network sets 0.0.0.0, as docker-compose.yml does)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from spec_batch.settings import get_settings

    addr = addr or get_settings().metrics_host

    registry = CollectorRegistry()
    _ReapingCollector(registry)
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:  # the worker still works; say loudly why nobody can scrape it
        log.error(
            "cannot serve metrics on %s:%d (SPEC_BATCH_METRICS_HOST, SPEC_BATCH_METRICS_PORT): %s", addr, port, exc
        )
        return
    log.warning("Prometheus metrics on http://%s:%d/metrics", addr, port)


def process_exited(pid: int | None = None) -> None:
    """A pool child is going away: its live gauge (requests in progress) stops counting."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())


def shutdown() -> None:
    """Main process at exit: removes the directory prepare() created (a directory given by the user stays)."""
    global _created_dir
    if _created_dir is not None:
        shutil.rmtree(_created_dir, ignore_errors=True)
        _created_dir = None


class _ReapingCollector:
    """MultiProcessCollector that first drops the live gauges of processes that died without shutting down
    (a pool child killed by the time limit or the OOM killer)."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self._path = os.environ[MULTIPROC_DIR_ENV]
        self._inner = MultiProcessCollector(None, self._path)
        registry.register(self)

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client import multiprocess

        for path in glob.glob(os.path.join(self._path, "gauge_live*_*.db")):
            m = _LIVE_GAUGE_FILE.search(os.path.basename(path))
            if m and not pid_alive(int(m.group(1))):
                multiprocess.mark_process_dead(int(m.group(1)), self._path)
        return self._inner.collect()


@dataclass(frozen=True)
class _Metrics:
    requests: Any
    output_tokens: Any
    draft_tokens: Any
    accepted_tokens: Any
    accepted_per_position: Any
    target_forwards: Any
    latency: Any
    step_seconds: Any
    in_progress: Any


@lru_cache(maxsize=1)
def _metrics() -> _Metrics:
    """Created on first use (after prepare() in a worker), once per process, on the default registry."""
    from prometheus_client import Counter, Gauge, Histogram

    return _Metrics(
        requests=Counter(
            "spec_batch_requests", "Requests whose result a worker stored, by status.", [*LABELS, "status"]
        ),
        output_tokens=Counter("spec_batch_output_tokens", "Output tokens of stored results.", LABELS),
        draft_tokens=Counter("spec_batch_draft_tokens", "Draft tokens proposed and checked by the target.", LABELS),
        accepted_tokens=Counter("spec_batch_accepted_tokens", "Draft tokens the target accepted.", LABELS),
        accepted_per_position=Counter(
            "spec_batch_accepted_tokens_per_position",
            "Accepted draft tokens by position in the draft (1 = the first drafted token of a step).",
            [*LABELS, "position"],
        ),
        target_forwards=Counter(
            "spec_batch_target_forwards", "Steps: target forward passes after the prefill.", LABELS
        ),
        latency=Histogram(
            "spec_batch_request_latency_seconds",
            "A request's decode time, admission to finish.",
            LABELS,
            buckets=LATENCY_BUCKETS,
        ),
        step_seconds=Histogram(
            "spec_batch_step_seconds",
            "A request's mean seconds per step (its decode time / its target forwards).",
            LABELS,
            buckets=STEP_BUCKETS,
        ),
        in_progress=Gauge(
            "spec_batch_requests_in_progress",
            "Requests claimed by a worker and not stored yet.",
            LABELS,
            multiprocess_mode="livesum",
        ),
    )


def _count(stats: Any, name: str) -> int:
    return int(getattr(stats, name, None) or 0)


def record_request(*, target: str, drafter: str, status: str, stats: Any | None) -> None:
    """Counts one stored result: `status` as stored (completed | failed), `stats` its RequestStats (or None)."""
    m = _metrics()
    labels = {"target": target, "drafter": drafter}
    m.requests.labels(status=status, **labels).inc()
    if stats is None:
        return
    for metric, name in (
        (m.output_tokens, "output_tokens"),
        (m.draft_tokens, "draft_tokens"),
        (m.accepted_tokens, "accepted_tokens"),
        (m.target_forwards, "target_forwards"),
    ):
        value = _count(stats, name)
        if value:
            metric.labels(**labels).inc(value)
    for index, accepted in enumerate(getattr(stats, "accepted_per_position", None) or ()):
        if accepted:
            m.accepted_per_position.labels(position=str(index + 1), **labels).inc(accepted)
    wall_s = float(getattr(stats, "wall_s", 0.0) or 0.0)
    if wall_s > 0:
        m.latency.labels(**labels).observe(wall_s)
        forwards = _count(stats, "target_forwards")
        if forwards:
            m.step_seconds.labels(**labels).observe(wall_s / forwards)


class ChunkMetrics:
    """The metrics of one chunk a worker holds: its requests count as in progress from the start until each is
    stored (:meth:`on_stored`, which also counts it) or the chunk ends (:meth:`close`)."""

    def __init__(self, *, target: str, drafter: str, n: int) -> None:
        self.target, self.drafter = target, drafter
        self._in_progress = _metrics().in_progress.labels(target=target, drafter=drafter)
        self._left = max(0, n)
        self._in_progress.inc(self._left)

    def on_stored(self, status: str, stats: Any | None) -> None:
        """The runner's on_stored: one request row stored with `status` and `stats`."""
        record_request(target=self.target, drafter=self.drafter, status=status, stats=stats)
        if self._left > 0:
            self._left -= 1
            self._in_progress.dec()

    def close(self) -> None:
        if self._left:
            self._in_progress.dec(self._left)
            self._left = 0
