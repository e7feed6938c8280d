"""One online request in the shared engine: its n choices submitted as rows, their updates brought back to the
event loop, and every row cancelled when the request ends early (a client that disconnects frees its rows).

The engine calls each row's sink on its own thread; the sink only hands the update to the request's event loop
(`call_soon_threadsafe`), so the engine never waits for a client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from spec_batch.core.engine import Engine, EngineClosed, RowHandle
from spec_batch.core.engine_batch import RowUpdate
from spec_batch.core.outputs import GenerationResult
from spec_batch.errors import SpecBatchError
from spec_batch.jobs.choices import choices_of
from spec_batch.openai_format import ParsedBody
from spec_batch.openai_format.prompts import build_prompt, prompt_error_code, prompt_list
from spec_batch.server.errors import APIError, invalid_request

DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request looks for its client having gone


class OnlineCall:
    """The rows of one request's choices. Use `start()`, then `updates()` (or `results()`), and `cancel()` in a
    finally block."""

    def __init__(self, engine: Engine, parsed: ParsedBody) -> None:
        self.engine = engine
        self.parsed = parsed
        self.prompts = prompt_list(parsed.endpoint, parsed.prompt)
        self.per_prompt = parsed.n
        self.n = parsed.n * len(self.prompts)  # choices in all: prompt k's choice j is choice k * n + j
        self._queue: asyncio.Queue[tuple[int, RowUpdate]] = asyncio.Queue()
        self._handles: list[RowHandle] = []
        self.results: list[GenerationResult | None] = [None] * self.n

    async def start(self) -> None:
        """Builds the prompt (chat template, grammar) off the event loop, then queues one row per choice.
        A prompt the model cannot take is a 400 naming why."""
        loop = asyncio.get_running_loop()
        try:
            requests = await asyncio.to_thread(self._prepare)
        except SpecBatchError as exc:
            raise invalid_request(str(exc), code=prompt_error_code(exc)) from None
        try:
            for index, request in enumerate(requests):
                self._handles.append(self.engine.submit(request, self._sink(loop, index)))
        except EngineClosed as exc:
            self.cancel()
            raise APIError(503, str(exc), code="server_shutting_down") from None

    def _prepare(self) -> list[Any]:
        built = [build_prompt(self.engine.decoder, self.parsed.endpoint, p) for p in self.prompts]
        choices = choices_of(built, self.parsed.params, self.per_prompt)
        return [self.engine.prepare(prompt, p, i) for i, (prompt, p) in enumerate(choices)]

    def _sink(self, loop: asyncio.AbstractEventLoop, index: int):  # type: ignore[no-untyped-def]
        def sink(update: RowUpdate) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, (index, update))  # raises once the loop is closed

        return sink

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.results)

    def _take(self, index: int, update: RowUpdate) -> None:
        if update.result is not None:
            self.results[index] = update.result

    async def updates(self) -> AsyncIterator[tuple[int, RowUpdate]]:
        """(choice index, update) as the engine produces them, until every choice has its result."""
        while not self.finished:
            index, update = await self._queue.get()
            self._take(index, update)
            yield index, update

    async def wait(self, disconnected: Callable[[], Awaitable[bool]]) -> list[GenerationResult]:
        """Every choice's result; `disconnected()` is asked every DISCONNECT_CHECK_S (updates arrive every step,
        so the clock decides, not a quiet queue), and a client that went away cancels the rows (they end
        "cancelled" at the engine's next step)."""
        checked = time.monotonic()
        while not self.finished:
            try:
                index, update = await asyncio.wait_for(self._queue.get(), DISCONNECT_CHECK_S)
                self._take(index, update)
            except TimeoutError:
                pass
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await disconnected():
                    self.cancel()
        return [r for r in self.results if r is not None]

    def cancel(self) -> None:
        for handle in self._handles:
            handle.cancel()
