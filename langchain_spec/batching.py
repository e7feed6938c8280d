"""Batching. LangChain runs a chat model's batch() as one invoke() per input; to make it one batched call of the core,
batch()/generate() (and their async forms) decode every prompt first, in one Decoder.generate call, and leave the
results where the per-input _generate calls that LangChain then makes pick them up (keyed by prompt token ids and
sampling parameters). LangChain's own path still runs callbacks, tracing, message ids and output_version handling
for each input. Results nobody picks up (say, an input that a cache answered) are dropped with the batch.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from langchain_core.caches import BaseCache
from langchain_core.callbacks import Callbacks
from langchain_core.globals import get_llm_cache
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import LLMResult
from langchain_core.runnables import RunnableConfig

from spec_batch import GenerationResult, SpecBatchError

from ._core import CallOptions, adecode_many, decode_many

# Keyword arguments of BaseChatModel.generate that are LangChain's, not the model's.
GENERATE_ONLY = frozenset(
    {"tags", "metadata", "run_name", "run_id", "ls_structured_output_format", "structured_output_format"}
)

_PrefetchKey = tuple[tuple[int, ...], tuple]


class _Prefetched:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[_PrefetchKey, list[GenerationResult | BaseException]] = {}

    def put(self, key: _PrefetchKey, outcome: GenerationResult | BaseException) -> None:
        with self._lock:
            self._items.setdefault(key, []).append(outcome)

    def take(self, key: _PrefetchKey) -> GenerationResult | BaseException | None:
        with self._lock:
            outcomes = self._items.get(key)
            return outcomes.pop(0) if outcomes else None


_prefetched: ContextVar[_Prefetched | None] = ContextVar("langchain_spec_prefetched", default=None)


@contextlib.contextmanager
def _visible(store: _Prefetched | None) -> Iterator[None]:
    """Makes store the prefetched results of the calls inside (an outer batch's store stays visible otherwise)."""
    if store is None:
        yield
        return
    token = _prefetched.set(store)
    try:
        yield
    finally:
        _prefetched.reset(token)


@dataclass
class _BatchPlan:
    decoder: Any
    options: CallOptions
    prompts: list[list[int]]

    def args(self, batch_size: int) -> tuple[Any, list[list[int]], CallOptions, int]:
        return self.decoder, self.prompts, self.options, batch_size


def take_prefetched(ids: list[int], options: CallOptions) -> GenerationResult | None:
    store = _prefetched.get()
    if store is None:
        return None
    outcome = store.take((tuple(ids), options.key))
    if isinstance(outcome, BaseException):
        # The batched call failed (a timeout, ...): every input of the batch raises that error, each its
        # own copy (several threads raise at once).
        raise copy.copy(outcome) from outcome
    return outcome


class PrefetchingBatches:
    """ChatSpeculative's batch(), abatch(), generate() and agenerate(): every prompt decoded in one core call
    first (module docstring), then LangChain's own per-input path. Needs the model's _call, _get_decoder,
    _prompt_ids, cache and batch_size."""

    def _plan_batch(
        self, message_lists: Sequence[Sequence[BaseMessage]], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> _BatchPlan | None:
        """What a batched call would decode, or None when the per-input path should do everything itself:
        fewer than two prompts, a LangChain cache in use, or bad parameters (each input then reports its error)."""
        if len(message_lists) < 2:
            return None
        if self.cache is not False and (isinstance(self.cache, BaseCache) or get_llm_cache() is not None):
            return None
        try:
            options, plan = self._call(stop, {k: v for k, v in kwargs.items() if k != "stop"})
            decoder = self._get_decoder()
        except Exception:
            return None
        prompts: list[list[int]] = []
        for messages in message_lists:
            try:
                prompts.append(self._prompt_ids(decoder, messages, plan))
            except Exception:
                continue
        return _BatchPlan(decoder, options, prompts) if len(prompts) >= 2 else None

    @staticmethod
    def _store(plan: _BatchPlan, outcome: list[GenerationResult] | Exception) -> _Prefetched | None:
        if isinstance(outcome, SpecBatchError):
            return None  # nothing decoded: every input runs, and reports its own error, on its own path
        store = _Prefetched()
        for i, ids in enumerate(plan.prompts):
            key = (tuple(ids), plan.options.key)
            if isinstance(outcome, Exception):
                store.put(key, outcome)  # a timeout or failure of the batched call fails every input
            elif outcome[i].finish_reason != "error":
                # A prompt the core refused (too long for the context, ...) is decoded again on its own path,
                # which raises the core's own typed error for that input only.
                store.put(key, outcome[i])
        return store

    @contextlib.contextmanager
    def _prefetch(
        self, message_lists: Sequence[Sequence[BaseMessage]], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[None]:
        plan = self._plan_batch(message_lists, stop, kwargs)
        store = None
        if plan is not None:
            try:
                store = self._store(plan, decode_many(*plan.args(self.batch_size), return_errors=True))
            except Exception as exc:
                store = self._store(plan, exc)
        with _visible(store):
            yield

    @contextlib.asynccontextmanager
    async def _aprefetch(
        self, message_lists: Sequence[Sequence[BaseMessage]], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> AsyncIterator[None]:
        plan = self._plan_batch(message_lists, stop, kwargs)
        store = None
        if plan is not None:
            try:
                store = self._store(plan, await adecode_many(*plan.args(self.batch_size), return_errors=True))
            except Exception as exc:
                store = self._store(plan, exc)
        with _visible(store):
            yield

    def _input_messages(self, inputs: Sequence[LanguageModelInput]) -> list[list[BaseMessage]]:
        try:
            return [self._convert_input(x).to_messages() for x in inputs]
        except Exception:
            return []

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:  # type: ignore[override]
        with self._prefetch(self._input_messages(inputs), kwargs.get("stop"), kwargs):
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)  # type: ignore[return-value]

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:  # type: ignore[override]
        async with self._aprefetch(self._input_messages(inputs), kwargs.get("stop"), kwargs):
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)  # type: ignore[return-value]

    def generate(
        self,
        messages: list[list[BaseMessage]],
        stop: list[str] | None = None,
        callbacks: Callbacks = None,
        **kwargs: Any,
    ) -> LLMResult:
        call_kwargs = {k: v for k, v in kwargs.items() if k not in GENERATE_ONLY}
        with self._prefetch(messages, stop, call_kwargs):
            return super().generate(messages, stop=stop, callbacks=callbacks, **kwargs)

    async def agenerate(
        self,
        messages: list[list[BaseMessage]],
        stop: list[str] | None = None,
        callbacks: Callbacks = None,
        **kwargs: Any,
    ) -> LLMResult:
        call_kwargs = {k: v for k, v in kwargs.items() if k not in GENERATE_ONLY}
        async with self._aprefetch(messages, stop, call_kwargs):
            return await super().agenerate(messages, stop=stop, callbacks=callbacks, **kwargs)
