"""What both LangChain models share: call options, deadlines, metadata.

Nothing here imports LangChain; `llms.py` and `chat_models.py` turn these results into LangChain objects.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from spec_batch import (
    GenerationResult,
    InvalidParameterError,
    RequestStats,
    SamplingParams,
    SpecBatchError,
    StreamChunk,
)
from spec_batch.limits import TEMPERATURE, TOP_P, check_range, check_seed

Prompt = str | list[int]


def check_decoder(value: Any) -> Any:
    """An existing decoder must look like spec_batch.Decoder (duck-typed so wrappers and fakes work)."""
    if value is None:
        return None
    missing = [name for name in ("generate", "stream", "target_name", "draft_name") if not hasattr(value, name)]
    if missing:
        raise InvalidParameterError(
            f"decoder= must be a spec_batch Decoder (from spec_batch.load_decoder); {type(value).__name__} "
            f"has no {', '.join(missing)}"
        )
    return value


# ---------------------------------------------------------------------------------------------------------------
# Call options: the instance's fields, overridden per call; anything unknown is an error.
# ---------------------------------------------------------------------------------------------------------------

# Per-call keyword arguments accepted by invoke/stream/batch (and .bind), each overriding the field of that name.
CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "timeout", "response_format")
# LangChain's own switch (`invoke(..., stream=True)`); LangChain routes on it before the model sees it.
ROUTING_OPTIONS = ("stream",)

_HINTS = {
    "model": "the target is fixed per instance; create another instance with target=... instead",
    "tools": "tool calling is ChatSpeculative's: use ChatSpeculative.bind_tools",
    "tool_choice": "tool calling is ChatSpeculative's: use ChatSpeculative.bind_tools",
    "functions": "OpenAI's legacy functions are not supported: use ChatSpeculative.bind_tools",
    "n": "spec-batch returns one generation per prompt; repeat the prompt (with a seed each) instead",
    "max_new_tokens": "the LangChain name of this parameter is max_tokens",
}


@dataclass(frozen=True)
class CallOptions:
    params: SamplingParams
    timeout: float | None

    @property
    def key(self) -> tuple:
        p = self.params
        fmt = p.response_format.key if p.response_format is not None else None
        return (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed, tuple(p.stop), fmt)


def check_limits(temperature: Any, top_p: Any, seed: Any) -> None:
    """OpenAI's ranges (spec_batch.limits), as at every user-facing boundary; the core's SamplingParams is wider."""
    check_range("temperature", temperature, TEMPERATURE)
    check_range("top_p", top_p, TOP_P)
    check_seed("seed", seed)


def resolve_options(model: Any, stop: list[str] | None, kwargs: dict[str, Any]) -> CallOptions:
    """Sampling params and timeout for one call: the model's fields, overridden by per-call kwargs.

    A per-call `stop` replaces the instance's `stop` (as in LangChain's OpenAI models); the core cuts the
    output at the first stop string, which is not included.
    """
    unknown = sorted(set(kwargs) - set(CALL_OPTIONS) - set(ROUTING_OPTIONS))
    if unknown:
        hints = "; ".join(f"{k}: {_HINTS[k]}" for k in unknown if k in _HINTS)
        raise InvalidParameterError(
            f"unsupported parameter(s) {unknown} for {type(model).__name__}"
            + (f" ({hints})" if hints else "")
            + f"; per-call parameters are {list(CALL_OPTIONS)} and stop"
        )
    values = {name: kwargs.get(name, getattr(model, name)) for name in CALL_OPTIONS}
    timeout = values.pop("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidParameterError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    chosen_stop = stop if stop is not None else model.stop
    check_limits(values["temperature"], values["top_p"], values["seed"])
    params = SamplingParams(
        max_new_tokens=values["max_tokens"],
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=values["top_k"],
        seed=values["seed"],
        stop=list(chosen_stop or []),
        response_format=values["response_format"],
    )
    return CallOptions(params=params, timeout=None if timeout is None else float(timeout))


# ---------------------------------------------------------------------------------------------------------------
# Deadlines. The core has no deadline argument, so the adapter enforces `timeout`:
# - a single prompt is decoded through `Decoder.stream` in a worker thread that checks, after every step, whether
#   the caller has given up (timeout, closed stream, cancelled task) and then closes the core's generator, which
#   ends that decode and frees the decoder for the next request;
# - a batch is one `Decoder.generate` call in a worker thread; the caller gets TimeoutError at the deadline, and
#   the core, asked before every step through `should_stop`, stops the batch after the step in progress.
# ---------------------------------------------------------------------------------------------------------------


class GenerationTimeout(TimeoutError):
    """A call of a spec-batch LangChain model ran past its `timeout`."""


def _timeout_error(timeout: float | None, what: str) -> GenerationTimeout:
    return GenerationTimeout(f"{what} did not finish within timeout={timeout} s; raise timeout= or lower max_tokens")


_CHUNK, _END, _ERROR = 0, 1, 2


class StreamWorker:
    """Runs `decoder.stream(prompt, params)` in its own thread and hands its chunks over a queue.

    The core's generator is created, advanced and closed in that one thread, whatever thread (or event loop)
    consumes it. `close()` asks it to stop; it stops after the step in progress.
    """

    def __init__(
        self, decoder: Any, prompt: Prompt, params: SamplingParams, *, loop: asyncio.AbstractEventLoop | None = None
    ):
        self._decoder = decoder
        self._prompt = prompt
        self._params = params
        self._cancel = threading.Event()
        self._loop = loop
        self._sync_q: queue.SimpleQueue | None = None if loop else queue.SimpleQueue()
        self._async_q: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._thread = threading.Thread(target=self._run, name="spec-batch-stream", daemon=True)
        self._thread.start()

    def _emit(self, item: tuple[int, Any]) -> None:
        if self._loop is None:
            assert self._sync_q is not None
            self._sync_q.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_q.put_nowait, item)  # type: ignore[union-attr]
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            self._cancel.set()

    def _run(self) -> None:
        try:
            generator = self._decoder.stream(self._prompt, self._params)
            try:
                for chunk in generator:
                    self._emit((_CHUNK, chunk))
                    if self._cancel.is_set():
                        return
            finally:
                close = getattr(generator, "close", None)
                if close is not None:
                    close()
            self._emit((_END, None))
        except BaseException as exc:
            self._emit((_ERROR, exc))

    def close(self) -> None:
        self._cancel.set()

    @staticmethod
    def _unpack(item: tuple[int, Any]) -> StreamChunk | None:
        kind, value = item
        if kind == _ERROR:
            raise value
        return value if kind == _CHUNK else None

    def iter(self, deadline: float | None, timeout: float | None) -> Iterator[StreamChunk]:
        """Chunks until the last; GenerationTimeout at the deadline. Closing the iterator stops the decode."""
        assert self._sync_q is not None
        try:
            while True:
                if deadline is None:
                    item = self._sync_q.get()
                else:
                    remaining = deadline - time.monotonic()
                    try:
                        if remaining <= 0:
                            raise queue.Empty
                        item = self._sync_q.get(timeout=remaining)
                    except queue.Empty:
                        raise _timeout_error(timeout, "the generation") from None
                chunk = self._unpack(item)
                if chunk is None:
                    return
                yield chunk
        finally:
            self.close()

    async def aiter(self, deadline: float | None, timeout: float | None) -> AsyncIterator[StreamChunk]:
        assert self._async_q is not None
        try:
            while True:
                if deadline is None:
                    item = await self._async_q.get()
                else:
                    remaining = deadline - time.monotonic()
                    try:
                        if remaining <= 0:
                            raise TimeoutError
                        item = await asyncio.wait_for(self._async_q.get(), remaining)
                    except TimeoutError:
                        raise _timeout_error(timeout, "the generation") from None
                chunk = self._unpack(item)
                if chunk is None:
                    return
                yield chunk
        finally:
            self.close()


def deadline_for(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def result_from_chunks(chunks: Sequence[StreamChunk]) -> GenerationResult:
    """The GenerationResult a stream adds up to (text and token ids joined; reason and stats from the last chunk)."""
    if not chunks or chunks[-1].finish_reason is None:
        raise SpecBatchError("the decoder's stream ended without a final chunk (finish_reason and stats)")
    last = chunks[-1]
    return GenerationResult(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        stats=last.stats or RequestStats(),
    )


def decode_one(decoder: Any, prompt: Prompt, options: CallOptions) -> GenerationResult:
    """One prompt, stoppable at every step, within options.timeout."""
    worker = StreamWorker(decoder, prompt, options.params)
    return result_from_chunks(list(worker.iter(deadline_for(options.timeout), options.timeout)))


async def adecode_one(decoder: Any, prompt: Prompt, options: CallOptions) -> GenerationResult:
    """decode_one for an event loop: waits without blocking it; cancelling the task stops the decode."""
    worker = StreamWorker(decoder, prompt, options.params, loop=asyncio.get_running_loop())
    chunks = [c async for c in worker.aiter(deadline_for(options.timeout), options.timeout)]
    return result_from_chunks(chunks)


def _start_batch(
    decoder: Any, prompts: Sequence[Prompt], options: CallOptions, batch_size: int, return_errors: bool
) -> tuple[Future, threading.Event]:
    """Runs one Decoder.generate call in its own thread; setting the event stops it after the step in progress."""
    stop_event = threading.Event()
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(
                decoder.generate(
                    list(prompts),
                    options.params,
                    batch_size=batch_size,
                    return_errors=return_errors,
                    should_stop=stop_event.is_set,
                )
            )
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="spec-batch-generate", daemon=True).start()
    return future, stop_event


def decode_many(
    decoder: Any, prompts: Sequence[Prompt], options: CallOptions, batch_size: int, *, return_errors: bool = False
) -> list[GenerationResult]:
    """All prompts in one batched call of the core, within options.timeout."""
    if options.timeout is None:
        return decoder.generate(list(prompts), options.params, batch_size=batch_size, return_errors=return_errors)
    future, stop_event = _start_batch(decoder, prompts, options, batch_size, return_errors)
    try:
        return future.result(timeout=options.timeout)
    except TimeoutError:
        if future.done() and future.exception() is not None:
            raise
        raise _timeout_error(options.timeout, f"the batch of {len(prompts)} prompts") from None
    finally:
        stop_event.set()


async def adecode_many(
    decoder: Any, prompts: Sequence[Prompt], options: CallOptions, batch_size: int, *, return_errors: bool = False
) -> list[GenerationResult]:
    future, stop_event = _start_batch(decoder, prompts, options, batch_size, return_errors)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), options.timeout)
    except TimeoutError:
        if future.done() and future.exception() is not None:
            raise
        raise _timeout_error(options.timeout, f"the batch of {len(prompts)} prompts") from None
    finally:
        stop_event.set()


# ---------------------------------------------------------------------------------------------------------------
# Metadata (the same keys on both models).
# ---------------------------------------------------------------------------------------------------------------


def response_metadata(decoder: Any, finish_reason: str | None, stats: RequestStats | None) -> dict[str, Any]:
    """model_name, draft_name, finish_reason and the speculative statistics of one request."""
    return {
        "model_name": decoder.target_name,
        "draft_name": decoder.draft_name,
        "finish_reason": finish_reason,
        "speculative_stats": (stats or RequestStats()).to_dict(),
    }


def usage(stats: RequestStats | None) -> dict[str, int]:
    s = stats or RequestStats()
    return {
        "input_tokens": s.prompt_tokens,
        "output_tokens": s.output_tokens,
        "total_tokens": s.prompt_tokens + s.output_tokens,
    }
