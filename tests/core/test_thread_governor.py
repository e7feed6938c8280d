"""core/thread_governor.py: a step's CPU threads follow what other processes leave of this process's CPUs, with a
band between dropping a thread and taking it back; the /proc reader's samples are sane on Linux."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from spec_batch.core import thread_governor
from spec_batch.core.thread_governor import CpuSample, ThreadGovernor, cpu_governor, read_cpu, threads_for


@pytest.mark.parametrize(
    "current,others,want",
    [
        (2, 0.0, 2),
        (2, 0.45, 2),  # under DOWN: kept
        (2, 0.67, 1),  # one busy process beside 2 threads gets ~2/3 of a core
        (1, 1.0, 1),
        (1, 0.45, 1),  # between UP and DOWN: a thread dropped is not taken back yet
        (1, 0.3, 2),  # under UP: taken back
        (2, 1.9, 1),  # never fewer than 1
        (1, 1.4, 1),
    ],
)
def test_the_count_follows_the_other_processes_with_a_band_between_down_and_up(current, others, want):
    assert threads_for(current, 2, others) == want


def test_more_cpus_give_up_one_thread_per_cpu_taken():
    assert [threads_for(8, 8, others) for others in (0.2, 0.6, 2.7, 7.9, 12.0)] == [8, 7, 5, 1, 1]
    assert threads_for(5, 8, 0.2) == 8  # all free again: every thread back at once


class Machine:
    """CpuSamples as a fake /proc would give them: `others` CPUs used by other processes, `ours` by this one."""

    def __init__(self):
        self.now, self.busy, self.ours = 0.0, 0.0, 0.0

    def run(self, seconds: float, others: float, ours: float = 1.0) -> None:
        self.now += seconds
        self.busy += seconds * (others + ours)
        self.ours += seconds * ours

    def sample(self) -> CpuSample:
        return CpuSample(self.now, self.busy, self.ours)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back_when_it_stops(restore_threads):
    machine = Machine()
    governor = ThreadGovernor(2, interval=0.5, sample=machine.sample, clock=lambda: machine.now)
    seen = []
    for others in (0.0, 0.0, 0.7, 1.0, 1.0, 0.5, 0.1, 0.0):
        machine.run(0.6, others)
        seen.append(governor.tick())
        assert torch.get_num_threads() == governor.threads  # set on the thread that ticks
    assert seen == [2, 2, 1, 1, 1, 1, 2, 2]
    assert governor.others == pytest.approx(0.0)


def test_between_samples_a_tick_only_reapplies_the_count(restore_threads):
    machine = Machine()
    governor = ThreadGovernor(2, interval=0.5, sample=machine.sample, clock=lambda: machine.now)
    machine.run(0.6, 1.0)
    assert governor.tick() == 1
    machine.run(0.1, 0.0)  # quiet, but the interval has not passed: no new sample
    torch.set_num_threads(2)  # something else changed this thread's count
    assert governor.tick() == 1 and torch.get_num_threads() == 1


def test_each_stepping_thread_gets_the_governed_count(restore_threads):
    """OpenMP's count is per thread: a step run on another thread (a caller of generate, the engine's) is set too."""
    machine = Machine()
    governor = ThreadGovernor(2, interval=0.0, sample=machine.sample, clock=lambda: machine.now)
    machine.run(1.0, 1.0)
    governor.tick()
    counts = []

    def step() -> None:
        torch.set_num_threads(2)
        governor.tick()
        counts.append(torch.get_num_threads())

    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    assert counts == [1]


def test_no_sample_keeps_the_count():
    governor = ThreadGovernor(2, interval=0.0, sample=lambda: None)
    assert governor.tick() == 2 and governor.others == 0.0
    with pytest.raises(ValueError, match="most"):
        ThreadGovernor(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_proc_samples_count_this_process_and_every_process_on_its_cpus():
    cpus = frozenset(os.sched_getaffinity(0))
    first = read_cpu(cpus)
    total = 0
    for i in range(3_000_000):  # ~0.1-0.3 s of this process on a CPU
        total += i
    second = read_cpu(cpus)
    assert first is not None and second is not None and total > 0
    elapsed = second.at - first.at
    ours, busy = second.ours - first.ours, second.busy - first.busy
    assert 0.0 < ours <= elapsed * len(cpus) + 0.05
    assert busy >= ours - 0.05  # every process's busy time includes ours (to a clock tick)
    assert busy <= elapsed * len(cpus) + 0.05


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="2 CPUs, Linux")
def test_decoders_share_the_process_governor_even_while_it_holds_a_thread_back(restore_threads, monkeypatch):
    monkeypatch.setattr(thread_governor, "_shared", None)
    cpu = torch.device("cpu")
    torch.set_num_threads(2)
    first = cpu_governor(cpu)
    assert first is not None and first.most == 2 and cpu_governor(cpu) is first
    first.threads = 1  # the machine got busy: the governor set 1 thread ...
    torch.set_num_threads(1)
    assert cpu_governor(cpu) is first  # ... and a decoder loaded now still gets 2 for its ceiling
    torch.set_num_threads(1)
    first.threads = 2
    assert cpu_governor(cpu) is None  # 1 thread that no governor set: the caller's choice, nothing to govern
    assert cpu_governor(torch.device("meta")) is None


def test_a_window_from_before_an_idle_spell_decides_nothing(restore_threads):
    """An idle server's first step after another process's busy minute: that minute is not now."""
    machine = Machine()
    governor = ThreadGovernor(2, interval=0.5, sample=machine.sample, clock=lambda: machine.now)
    machine.run(60.0, others=2.0, ours=0.0)  # no steps for a minute while something else was busy
    assert governor.tick() == 2  # a new window starts
    machine.run(0.6, others=0.0)
    assert governor.tick() == 2 and governor.others == pytest.approx(0.0)
    machine.run(0.6, others=1.0)
    assert governor.tick() == 1  # a window of the interval's length still decides


def test_a_forked_childs_first_window_decides_nothing(restore_threads):
    """A child's os.times start near zero: a window from the parent's sample would read as others' use."""
    machine = Machine()
    governor = ThreadGovernor(2, interval=0.5, sample=machine.sample, clock=lambda: machine.now)
    governor.pid = -1  # as if made in a parent process
    machine.ours = -100.0  # the child's own time restarts
    machine.run(0.6, others=0.0)
    assert governor.tick() == 2 and governor.pid == os.getpid()
    machine.run(0.6, others=1.0)
    assert governor.tick() == 1
