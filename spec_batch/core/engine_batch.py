"""The engine's requests (spec_batch/core/engine.py): a `Ticket` per submitted request (its caller's sink, its group,
whether it was cancelled) and the `Group` of one caller's requests (a limit, a stop, a job memory, plain or not).

A ticket is the sink of its row in the engine's running batch (core/batch/running_batch.py): it hands each update to its
caller and leaves its group's count with the last one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .batch.running_batch import RowUpdate, Sink
from .decoder import Request
from .drafting.job_memory import JobMemory

log = logging.getLogger("spec_batch.core.engine")


@dataclass
class Group:
    """Requests that share a limit, a stop and a memory: one `generate` call (its batch_size, should_stop and memory),
    or one online request."""

    limit: int | None = None  # at most this many of the group's rows decode at once; None: the engine's batch
    background: bool = False  # True (bulk rows): waits behind every waiting foreground (online) request
    should_stop: Callable[[], bool] | None = None  # asked once per step on the engine thread
    memory: JobMemory | None = None  # the job memory its rows draft from (None: an online request's own tokens)
    plain: bool = False  # its rows draft nothing (the baseline, decoded in the engine's steps)
    active: int = 0
    stopped: bool = False
    error: BaseException | None = None  # what should_stop raised (the group stops; its caller re-raises it)


@dataclass(eq=False)
class Ticket:
    """A submitted request; in the running batch, its row's sink."""

    request: Request
    sink: Sink
    group: Group
    cancelled: bool = False
    counted: bool = False  # counts in group.active (admitted to decode) until it leaves the batch
    done: bool = False  # its caller has its result

    def __call__(self, update: RowUpdate) -> None:
        if update.result is not None:
            self.done = True
            self.leave()
        try:
            self.sink(update)
        except Exception:  # a caller that cannot take its updates (its event loop closed) leaves
            log.warning("a request's caller could not take its update; its row is cancelled", exc_info=True)
            self.cancelled = True

    def leave(self) -> None:
        if self.counted:
            self.counted = False
            self.group.active -= 1


def check_groups(tickets: list[Ticket]) -> None:
    """A group whose should_stop says so cancels all its rows, running and waiting (asked once per step)."""
    groups = {id(t.group): t.group for t in tickets}
    for group in groups.values():
        if group.stopped or group.should_stop is None:
            continue
        try:
            group.stopped = bool(group.should_stop())
        except Exception as exc:
            group.stopped, group.error = True, exc
    for ticket in tickets:
        if ticket.group.stopped:
            ticket.cancelled = True
