"""One decoder shared by many callers: continuous batching across requests that arrive at any time.

`Decoder.generate` decodes the prompts of one call; two callers wait for each other. The engine drives one running
batch (core/batch/running_batch.py) on a background thread for everybody: between two steps it ends the rows whose caller
went away (`RowHandle.cancel`), admits waiting requests (their prompts are prefilled and their rows join the batch,
the same calls as a row joining inside one `generate`), runs one step and hands every row its step's tokens. A
row's output does not depend on the rows around it, so a request decoded here equals the same request through
`Decoder.generate` (greedy: plain greedy decoding).

Callers get their updates through a sink called on the engine thread (`RowUpdate`: the step's text delta, token
ids and logprobs; the last one carries the GenerationResult). A sink must be quick (put it on a queue). On top of
`prepare` + `submit`: `generate` and `stream` (Decoder's, through the shared batch) and `as_decoder()`, the object
with Decoder's interface that the batch runner decodes through, so batch rows and online requests share steps (a
job's rows with the job's memory; its baseline's rows plain, in the same steps).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecBatchError
from .batch.running_batch import RowUpdate, RunningBatch, Sink, end_row, failed_result
from .decoder import Decoder, Request, Results
from .drafting.job_memory import JobMemory
from .engine_batch import Group, Ticket, check_groups
from .inputs import Prompt
from .outputs import INTERNAL_ERROR, GenerationResult, RequestStats, StreamChunk
from .params import SamplingParams

log = logging.getLogger(__name__)


# A failed step's error for the rows in it: a request's own failures (a bad prompt, a grammar the engine gave up on)
# end that request alone, so what is left is the decoder's fault; its text may hold other requests' data.
STEP_FAILED = "decoding failed: an internal error of the decoder (its details are in the server's log)"


class EngineClosed(SpecBatchError):
    """The engine is shutting down and takes no new request."""


@dataclass
class RowHandle:
    """What a caller keeps of a submitted request: `cancel()` frees its row at the next step."""

    _ticket: Ticket = field(repr=False)

    def cancel(self) -> None:
        self._ticket.cancelled = True  # read by the engine thread between steps (a bool: no lock needed)


class Engine:
    """Owns `decoder` on one thread; `max_batch` rows decode at once (the rest wait, first come first served).

    `start()` starts the thread; `stop()` takes no new request, lets every admitted and waiting request finish,
    and returns when the thread has ended (the server's graceful shutdown). Both match the server's Service.
    """

    def __init__(self, decoder: Decoder, max_batch: int = 8):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder = decoder
        self.max_batch = max_batch
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # steps run so far (tests and metrics read it)
        self.most_rows = 0  # the largest batch a step has decoded

    # ---------------------------------------------------------------- callers

    def prepare(self, prompt: Any, params: SamplingParams, index: int = 0) -> Request:
        """Checks a prompt and builds its grammar on the caller's thread: a bad prompt raises here
        (PromptTooLongError, InvalidParameterError), before it waits for a row."""
        return self.decoder.prepare(prompt, params, index)

    def submit(self, request: Request, sink: Sink, group: Group | None = None) -> RowHandle:
        """Queues a prepared request; its row joins the batch at the next step with room."""
        return self.submit_many([request], [sink], group or Group())[0]

    def submit_many(self, requests: Sequence[Request], sinks: Sequence[Sink], group: Group) -> list[RowHandle]:
        """Queues prepared requests of one group at once: a step sees all of them or none (so one `generate` call's
        rows join the batch as they would inside Decoder.generate)."""
        tickets = [Ticket(request, sink, group) for request, sink in zip(requests, sinks)]
        with self._cv:
            if self._closing:
                raise EngineClosed("the server is shutting down and takes no new request")
            self._waiting.extend(tickets)
            self._cv.notify()
        if self._thread is None:
            self.start()
        return [RowHandle(ticket) for ticket in tickets]

    def start(self) -> None:
        with self._cv:
            if self._thread is not None:
                return
            self._closing = False
            self._thread = threading.Thread(target=self._loop, name="spec-batch-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            self._thread = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        batch_size: int = 8,
        *,
        return_errors: bool = False,
        on_result: Callable[[int, GenerationResult], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        memory: JobMemory | None = None,
        plain: bool = False,
    ) -> list[GenerationResult]:
        """`Decoder.generate` through the shared batch: the same arguments and results. At most batch_size of
        these prompts decode at once (beside other callers' rows); they are background rows: a waiting `stream` or
        `submit` (an online request) takes the next free row first. on_result runs on the calling thread. memory:
        the job memory these rows draft from (other callers' rows draft without it). plain: they draft nothing
        (`as_decoder().without_speculation()`)."""
        results = Results(len(prompts), on_result)
        requests = self.decoder.prepare_many(prompts, params, batch_size, return_errors, results.finish)
        done: queue.SimpleQueue[tuple[int, GenerationResult]] = queue.SimpleQueue()
        group = Group(limit=batch_size, should_stop=should_stop, background=True, memory=memory, plain=plain)
        self.submit_many(requests, [_final_only(request.index, done.put) for request in requests], group)
        for _ in requests:
            results.finish(*done.get())
        if group.error is not None:
            raise group.error
        return results.values

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """`Decoder.stream` through the shared batch: one chunk per step with tokens; the last carries
        finish_reason and stats. Closing the iterator early cancels the row."""
        updates: queue.SimpleQueue[RowUpdate] = queue.SimpleQueue()
        handle = self.submit(self.prepare(prompt, params or SamplingParams()), updates.put)
        try:
            while True:
                update = updates.get()
                yield update.chunk
                if update.result is not None:
                    return
        finally:
            handle.cancel()  # nothing if it finished; an abandoned stream frees its row

    def as_decoder(self) -> EngineDecoder:
        """An object with Decoder's interface (generate, stream, tokenizer, apply_chat_template, ...) whose
        decoding runs in this engine's shared batch."""
        return EngineDecoder(self)

    # ---------------------------------------------------------------- the engine thread

    def _loop(self) -> None:
        batch: RunningBatch[Ticket] = RunningBatch(self.decoder)
        while True:
            with self._cv:
                while not self._waiting and not batch and not self._closing:
                    self._cv.wait()
                if not self._waiting and not batch:
                    return  # closing, and nothing left to decode
                waiting = list(self._waiting)
            check_groups(batch.sinks + waiting)  # outside the lock: a should_stop may read a database
            with self._cv:
                admitted = self._admit(len(batch))
            try:
                self._step(batch, admitted)
            except Exception:  # a failed step fails the rows in it, never the engine
                log.exception("engine step failed")  # the details go to the log, never to the callers
                batch.fail(STEP_FAILED, INTERNAL_ERROR)
                for ticket in admitted:  # those the failure stopped before they joined the batch
                    if not ticket.done:
                        ticket(
                            RowUpdate(
                                StreamChunk("", [], "error"), failed_result(RequestStats(), STEP_FAILED, INTERNAL_ERROR)
                            )
                        )
                batch = RunningBatch(self.decoder)

    def _admit(self, running: int) -> list[Ticket]:
        """Waiting tickets that fit now, foreground before background, each in arrival order; a group at its limit
        lets later groups by."""
        room = self.max_batch - running
        admitted: list[Ticket] = []
        kept: deque[Ticket] = deque()
        # online requests first: a bulk job queues many rows at once, and a client should not wait behind them
        for ticket in sorted(self._waiting, key=lambda t: t.group.background):
            limit = ticket.group.limit
            if not ticket.cancelled and (room <= 0 or (limit is not None and ticket.group.active >= limit)):
                kept.append(ticket)
                continue
            if not ticket.cancelled:
                room -= 1
                ticket.group.active += 1
                ticket.counted = True
            admitted.append(ticket)  # a cancelled one is admitted only to end at once, never decoded
        self._waiting = kept
        return admitted

    def _step(self, batch: RunningBatch[Ticket], admitted: list[Ticket]) -> None:
        with self.decoder.exclusive():
            batch.end([b for b, ticket in enumerate(batch.sinks) if ticket.cancelled])
            joining = []
            for ticket in admitted:
                row = batch.new_row(ticket.request, ticket.group.memory, ticket.group.plain)
                if ticket.cancelled:  # its caller left before it got a row
                    end_row(row, ticket, "cancelled")
                else:
                    joining.append((row, ticket))
            if joining:
                batch.admit([row for row, _ in joining], [ticket for _, ticket in joining])
            if not batch:
                return
            rows = batch.step()
            self.steps += 1
            self.most_rows = max(self.most_rows, rows)


def _final_only(index: int, put: Callable[[tuple[int, GenerationResult]], None]) -> Sink:
    def sink(update: RowUpdate) -> None:
        if update.result is not None:
            put((index, update.result))

    return sink


class EngineDecoder:
    """Decoder's interface over an engine: generate and stream go through the shared batch; every other
    attribute (tokenizer, target_name, draft_name, max_context, apply_chat_template, ...) is the decoder's own.
    plain: its rows draft nothing (the baseline of a job run through the engine)."""

    def __init__(self, engine: Engine, plain: bool = False):
        self.engine = engine
        self.plain = plain

    def generate(self, *args: Any, **kwargs: Any) -> list[GenerationResult]:
        return self.engine.generate(*args, plain=self.plain, **kwargs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        return self.engine.stream(prompt, params)

    def without_speculation(self) -> EngineDecoder:
        """The baseline speedups are measured against, decoded in the engine's own steps: its rows draft nothing."""
        return EngineDecoder(self.engine, plain=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.decoder, name)
