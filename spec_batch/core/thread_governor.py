"""How many intra-op threads a CPU decode step gets: as many as the CPUs that other processes leave free.

Why: a step of a small model is ~120 parallel regions of 5-50 us, and each region waits for its slowest thread.
Beside another CPU-heavy process, one of our threads loses whole time slices to it and every region waits for that
thread. Beside one busy process on 2 cores (a 2-core Zen 5 VM, w4a8, the edit prompts at batch 1), 2 threads
decoded 58 tokens/s plainly and 95 with `suffix`; 1 thread, on the core the other process leaves, 168 and 251
(docs/benchmarks.md). Quiet, 2 threads are the faster. So between steps the governor looks at what the other
processes used of this process's CPUs over the last `interval` seconds and sets the thread count of the thread
that runs the steps to the CPUs they leave (at least 1, at most the count it started with).

The native kernels' bits do not depend on the thread count (loading/kernels/spin_pool.cpp: what a piece computes
does not depend on who runs it), so only speed changes; loading/factory.py gives a decoder a governor only where
its forward runs on them (`SPEC_BATCH_ADAPT_THREADS`, default on).

Linux only: the other processes' use is /proc/stat's busy time on this process's CPUs less this process's own
(`os.times`). Elsewhere there is no governor.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# A CPU counts as taken once the other processes use this much of it (and free again below UP): between the two
# the count stays, so a load near one threshold does not flip it every interval. Beside one busy process, 2 of our
# threads leave it ~2/3 of a core (three busy threads on two cores), 1 thread a whole one.
DOWN, UP = 0.5, 0.35
STALE = 3  # a window longer than this many intervals (and than a second) starts a new one instead of deciding


@dataclass(frozen=True)
class CpuSample:
    at: float  # seconds, monotonic
    busy: float  # CPU-seconds spent busy on our CPUs by every process (steal included: time we could not run)
    ours: float  # CPU-seconds this process has run


def read_cpu(cpus: frozenset[int], clock: Callable[[], float] = time.monotonic) -> CpuSample | None:
    """Now's sample from /proc/stat (None where there is none: not Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            values = [int(f) for f in fields[:8]] + [0] * (8 - len(fields[:8]))  # older kernels: fewer columns
            user, nice, system, _idle, _iowait, irq, softirq, steal = values
            ticks += user + nice + system + irq + softirq + steal
    own = os.times()
    return CpuSample(clock(), ticks / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def other_cpus(first: CpuSample | None, second: CpuSample | None) -> float | None:
    """The CPUs other processes used on average between two samples (None: no samples, or no time between)."""
    if first is None or second is None or second.at <= first.at:
        return None
    used = (second.busy - first.busy) - (second.ours - first.ours)
    return max(0.0, used / (second.at - first.at))


def this_process_cpus() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the OS does not say)."""
    return (
        frozenset(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else frozenset(range(os.cpu_count() or 1))
    )


def threads_for(current: int, most: int, others: float) -> int:
    """The thread count after `others` CPUs' worth of use by other processes, `current` threads now."""
    down = most - int(others + (1.0 - DOWN))  # a CPU is taken from DOWN of it on ...
    up = most - int(others + (1.0 - UP))  # ... and free again below UP
    target = down if down < current else up if up > current else current
    return max(1, min(most, target))


class ThreadGovernor:
    """Between steps (`tick`, on the thread that runs them): the intra-op thread count for what other processes
    leave of this process's CPUs. `sample` and `clock` are for tests (defaults: /proc/stat and the monotonic
    clock)."""

    def __init__(
        self,
        most: int,
        interval: float = 0.5,
        sample: Callable[[], CpuSample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.most = most
        self.threads = most
        self.pid = os.getpid()  # a forked child's own CPU time starts afresh (cpu_governor, tick)
        self.interval = interval
        self._stale = max(STALE * interval, 1.0)
        self._clock = clock
        self._sample = sample or (lambda: read_cpu(this_process_cpus(), clock))
        self._last = self._sample()
        self._due = clock() + interval
        self.others = 0.0  # the other processes' CPUs over the last interval (metrics and tests read it)

    def tick(self) -> int:
        """Sets this thread's torch thread count to the governed one (a new sample once an interval has passed)."""
        now = self._clock()
        if now >= self._due:
            self._due = now + self.interval
            sample = self._sample()
            last, self._last = self._last, sample
            if self.pid != os.getpid():  # a forked child: its own CPU time starts afresh, so the window does too
                self.pid, last = os.getpid(), None
            # a window much longer than the interval (no steps for a while: an idle server) says what the machine
            # did then, not now: it only starts the next window
            fresh = last is not None and sample is not None and sample.at - last.at <= self._stale
            others = other_cpus(last, sample) if fresh else None
            if others is not None:
                self.others = others
                threads = threads_for(self.threads, self.most, others)
                if threads != self.threads:
                    log.info("CPU threads %d -> %d: other processes used %.2f CPUs", self.threads, threads, others)
                self.threads = threads
        if torch.get_num_threads() != self.threads:  # per thread (OpenMP's count is): the caller's own
            torch.set_num_threads(self.threads)
        return self.threads


_shared: ThreadGovernor | None = None  # the process's governor: every decoder on the CPU shares it


def cpu_governor(device: torch.device) -> ThreadGovernor | None:
    """The process's governor for a decoder on `device`, where one can work (the CPU, Linux, more than one thread to
    govern); else None. It governs up to this thread's torch thread count when it is made; a decoder made later gets
    the same one while the count is still the governor's (its ceiling, or what it set: a second decoder loaded
    while the machine is busy must not take 1 thread for its ceiling), a new one where the caller set another."""
    global _shared
    cpus = this_process_cpus()
    if device.type != "cpu" or read_cpu(cpus) is None:
        return None
    current = torch.get_num_threads()
    shared = _shared if _shared is not None and _shared.pid == os.getpid() else None
    if shared is not None and current in (shared.threads, shared.most):
        return shared
    most = min(current, len(cpus))
    _shared = ThreadGovernor(most) if most >= 2 else None
    return _shared
