"""The engine's running batch (spec_batch/core/engine.py): the tickets of the rows in it, the target's cache and
the drafter, and how rows join (`_Batch.admit`), leave (`keep`) and hear of their tokens (`deliver`).

Joining and leaving are the same calls `Decoder._run` makes when rows finish and others take their place
inside one `generate`, so a row's tokens do not depend on when it joined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .decoder import Decoder, Request
from .drafters import Drafter
from .kv_batch import KVBatch
from .outputs import INTERNAL_ERROR, GenerationResult, RequestStats, StreamChunk
from .rows import Row

log = logging.getLogger("spec_batch.core.engine")


@dataclass
class RowUpdate:
    """One step of one row: the text and tokens it added (`chunk`); `result` is set on the row's last update."""

    chunk: StreamChunk
    result: GenerationResult | None = None


Sink = Callable[[RowUpdate], None]


@dataclass
class Group:
    """Requests that share a limit and a stop: one `generate` call (its batch_size and should_stop)."""

    limit: int | None = None  # at most this many of the group's rows decode at once; None: the engine's batch
    background: bool = False  # True (bulk rows): waits behind every waiting foreground (online) request
    should_stop: Callable[[], bool] | None = None  # asked once per step on the engine thread
    active: int = 0
    stopped: bool = False
    error: BaseException | None = None  # what should_stop raised (the group stops; its caller re-raises it)


@dataclass
class Ticket:
    request: Request
    sink: Sink
    group: Group
    cancelled: bool = False
    row: Row | None = None
    counted: bool = False  # counts in group.active (admitted to decode) until it leaves the batch

    def leave(self) -> None:
        if self.counted:
            self.counted = False
            self.group.active -= 1


class Batch:
    """The running batch of the engine thread: its rows' tickets, the target's cache and the drafter."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.tickets: list[Ticket] = []
        self.kv = KVBatch(decoder.target, decoder.device, 0)
        self.drafter: Drafter = decoder._new_drafter(None)

    def admit(self, admitted: list[Ticket]) -> None:
        rows = []
        for ticket in admitted:
            ticket.row = self.decoder._new_row(ticket.request, self.drafter)
            if ticket.cancelled:  # its caller left before it got a row
                ticket.leave()
                ticket.row.finish("cancelled")
                deliver(ticket, [], True)
            else:
                rows.append(ticket.row)
                self.tickets.append(ticket)
        if rows:
            self.decoder._admit(self.kv, self.drafter, rows, len(self.tickets) - len(rows))

    def drop_cancelled(self) -> None:
        gone = [t for t in self.tickets if t.cancelled]
        if not gone:
            return
        for ticket in gone:
            ticket.row.finish("cancelled")  # type: ignore[union-attr]
            deliver(ticket, [], True)
        self.keep([b for b, t in enumerate(self.tickets) if not t.cancelled])

    def keep(self, keep: list[int]) -> None:
        """Only these rows stay (the others finished or were cancelled): their caches and drafts follow."""
        if len(keep) == len(self.tickets):
            return
        for b in set(range(len(self.tickets))) - set(keep):
            self.tickets[b].leave()
        self.tickets = [self.tickets[b] for b in keep]
        self.drafter.keep_rows(keep)  # also when none stays: the drafter sees its rows' last tokens
        if keep:
            self.kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.decoder.device))
        else:
            self.kv = KVBatch(self.decoder.target, self.decoder.device, 0)
            self.drafter = self.decoder._new_drafter(None)

    def fail_all(self, admitted: list[Ticket], error: str) -> None:
        for ticket in {id(t): t for t in self.tickets + admitted}.values():
            ticket.leave()
            if ticket.row is not None and ticket.row.finished:
                continue
            stats = ticket.row.stats if ticket.row is not None else RequestStats()
            result = GenerationResult("", [], "error", stats, error=error, error_code=INTERNAL_ERROR)
            _send(ticket, RowUpdate(StreamChunk("", [], "error", stats), result))


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


def deliver(ticket: Ticket, new_ids: list[int], finished: bool) -> None:
    row = ticket.row
    assert row is not None
    text = row.text.stream_chunk(finished)
    logprobs = row.output_logprobs(len(row.output_ids) - len(new_ids))
    if finished:
        _send(ticket, RowUpdate(StreamChunk(text, new_ids, row.finish_reason, row.stats, logprobs), row.result()))
    elif text or new_ids:
        _send(ticket, RowUpdate(StreamChunk(text, new_ids, logprobs=logprobs)))


def _send(ticket: Ticket, update: RowUpdate) -> None:
    try:
        ticket.sink(update)
    except Exception:  # a caller that cannot take its updates (its event loop closed) leaves
        log.warning("a request's caller could not take its update; its row is cancelled", exc_info=True)
        ticket.cancelled = True
