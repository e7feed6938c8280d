"""A worker process's runtime: its database engine (never shared across a fork), loaded decoders, the heartbeat
thread with the reaper's tick and the process's row per queue it consumes (store/servers.py: a queued batch's
object says when no running worker serves its queue). One per process, created lazily where tasks run."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

from spec_batch.core.decoder_like import DecoderLike
from spec_batch.heap import freeze_heap
from spec_batch.jobs import lease
from spec_batch.jobs.heads import resolve_with_settings
from spec_batch.jobs.job_memory_store import JobMemories
from spec_batch.jobs.lifecycle import RunOutcome, after_run
from spec_batch.loading import shared_decoder
from spec_batch.settings import get_settings
from spec_batch.store import chunks, open_store, servers
from spec_batch.store.models import utcnow

from . import reaper
from .publish import publish_chunk

log = logging.getLogger("spec_batch.workers")


class Runtime:
    """What a worker process keeps: its database engine (never shared across a fork), loaded decoders, the
    heartbeat thread. Created lazily in the process that runs tasks (a pool child; the main process for the
    solo and threads pools)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.settings = get_settings()
        logging.getLogger("alembic").setLevel(logging.WARNING)  # SQLite migrating itself on open: not news
        self.session_factory = open_store(self.settings.database_url)
        self.device = self.settings.device or default_device()
        self._loaded: set[tuple[str, str]] = set()
        # the suffix drafter's memory of each job's outputs, kept across the job's chunks
        self.memories = JobMemories(self.settings.suffix_memory_jobs, self.settings.suffix_memory_tokens)
        self._last_adopt = 0.0
        self.worker_id = servers.process_id()
        self.queues: tuple[str, ...] = ()
        self._announced_at = float("-inf")
        self.heartbeat = lease.Heartbeat(
            self.session_factory, lease_seconds=self.settings.lease_seconds, on_tick=self.reap_tick
        ).start()

    # The reaper publishes with this process's producer pool.
    def publish(self, chunk: chunks.QueueChunk) -> None:
        publish_chunk(chunk.id, chunk.queue)

    def finalize(self, job_id: str) -> None:
        """The reaper found nothing of the job left to run: lifecycle completes (or settles) it."""
        after_run(self.session_factory, job_id, RunOutcome.FINISHED)

    def serve_queues(self, queues: Iterable[str]) -> None:
        """The queues this process consumes: announced now, then at the heartbeat's ticks."""
        self.queues = tuple(dict.fromkeys(queues))
        self._announced_at = float("-inf")
        self.announce()

    def announce(self) -> None:
        """Refreshes this process's rows in worker_queues, every servers.HEARTBEAT_S at most. The database briefly
        away costs a warning: the rows stop counting only after servers.LIVE_S."""
        if not self.queues or time.monotonic() - self._announced_at < servers.HEARTBEAT_S:
            return
        try:
            with self.session_factory.begin() as s:
                servers.worker_heartbeat(s, self.worker_id, self.queues, now=utcnow())
            self._announced_at = time.monotonic()
        except Exception as exc:
            log.warning("worker queues not announced: %s", lease.brief(exc))

    def withdraw(self) -> None:
        """This process stops: its rows go (a process killed leaves them to expire)."""
        if not self.queues:
            return
        self.queues = ()  # a heartbeat tick still under way announces nothing more
        try:
            with self.session_factory.begin() as s:
                servers.remove_worker(s, self.worker_id)
        except Exception as exc:
            log.warning("worker queues not withdrawn: %s", lease.brief(exc))

    def reap_tick(self) -> None:
        """The heartbeat's extra duty in a worker: its queues announced, one reaper pass, logged when it did
        something."""
        self.announce()
        rep = self.reap()
        if rep.any():
            log.warning("reaper: %s", rep)
        if rep.errors:
            raise RuntimeError("reaper: " + "; ".join(rep.errors[:3]))

    def reap(self) -> reaper.ReapReport:
        rep = reaper.reap(
            self.session_factory,
            broker_url=self.settings.broker_url,
            publish=self.publish,
            lease_seconds=self.settings.lease_seconds,
            max_attempts=self.settings.max_attempts,
            finalize=self.finalize,
        )
        now = time.monotonic()
        if not rep.errors and now - self._last_adopt >= self.settings.lease_seconds:
            self._last_adopt = now
            try:
                epoch = reaper.broker_epoch(self.settings.broker_url)
                rep.requeued += reaper.adopt_orphans(
                    self.session_factory,
                    grace_s=self.settings.lease_seconds,
                    publish=self.publish,
                    epoch=epoch,
                    chunk_size=self.settings.chunk_size,
                )
            except Exception as exc:
                rep.errors.append(f"orphans: {lease.brief(exc)}")
        return rep

    def decoder(self, target: str, drafter: str, weights: str | None = None, dtype: str | None = None) -> DecoderLike:
        """The process's decoder for the pair at the job's precision: loaded on first use (spec_batch.loading's one
        cache), then kept."""
        key = (target, drafter, weights, dtype)
        t0 = time.perf_counter()
        if key not in self._loaded:
            try:  # a progress bar per load, in every worker's log, says nothing
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            except Exception:  # pragma: no cover
                pass
        dec = shared_decoder(
            target,
            resolve_with_settings(drafter, self.settings),
            device=self.device,
            cache_dir=self.settings.cache_dir,
            num_draft_tokens=self.settings.num_draft_tokens,
            adaptive=self.settings.adaptive,
            weights=weights,
            dtype=dtype,
            draft_weights=self.settings.draft_weights,
            tree_width=self.settings.tree_width,
        )
        if key not in self._loaded:
            self._loaded.add(key)
            freeze_heap()  # a worker keeps what it loaded for life: later full collections skip it
            log.warning(
                "loaded %s + %s on %s in %.1fs (pid %d)",
                target,
                drafter,
                self.device,
                time.perf_counter() - t0,
                os.getpid(),
            )
        return dec


def default_device() -> str:
    """A worker's device where none is set: cuda where available, else cpu."""
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except Exception:  # pragma: no cover
        pass
    return "cpu"


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()
        return _runtime


def apply_torch_threads() -> None:
    threads = get_settings().torch_threads
    if not threads:
        return
    try:
        import torch

        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
    except Exception as exc:  # pragma: no cover
        log.warning("could not set torch threads to %s: %s", threads, exc)


def runtime_of_this_process() -> Runtime | None:
    """This process's runtime if it has made one (never one inherited across a fork); creates none."""
    return _runtime if _runtime is not None and _runtime.pid == os.getpid() else None


def stop_in_this_process() -> None:
    """A pool child's shutdown: its heartbeat stops and its queues are withdrawn (the runtime of a parent process is
    left alone)."""
    rt = runtime_of_this_process()
    if rt is not None:
        rt.heartbeat.stop()
        rt.withdraw()
