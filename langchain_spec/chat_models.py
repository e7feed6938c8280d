"""ChatSpeculative: a LangChain chat model (BaseChatModel) on the spec-batch core, using the target's chat template."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from langchain_core.caches import BaseCache
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.globals import get_llm_cache
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, LLMResult
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import ConfigDict

from spec_batch import GenerationResult, InvalidParameterError, SpecBatchError
from spec_batch.loading import MessageError, validate_messages

from ._base import SpeculativeParams
from .structured import Method, structured_output
from .tools import CallStream, ToolPlan, call_text, parse_calls
from ._core import (
    CallOptions,
    StreamWorker,
    adecode_many,
    adecode_one,
    deadline_for,
    decode_many,
    decode_one,
    response_metadata,
    usage,
)


class UnsupportedMessageError(MessageError):
    """A message ChatSpeculative cannot put into the chat template (images, tool calls, unknown roles or types)."""


def messages_to_dicts(messages: Sequence[BaseMessage], *, calls_in_content: bool = True) -> list[dict[str, Any]]:
    """LangChain messages -> chat messages, checked by spec-batch's one chat-message validator.

    system -> "system", human -> "user", ai -> "assistant", tool -> "tool" (with its tool_call_id), ChatMessage ->
    its own role (which must be a chat role). Content must be text (a string, or text blocks, which are joined);
    a `name` is ignored. An AIMessage's tool calls go along as OpenAI `tool_calls`, and, for templates that do
    not render those (calls_in_content), also as the JSON the model writes for a call, after its text.
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        extra: dict[str, Any] = {}
        content = message.content
        if isinstance(message, ChatMessage):
            role = message.role
        elif isinstance(message, SystemMessage):
            role = "system"
        elif isinstance(message, HumanMessage):
            role = "user"
        elif isinstance(message, AIMessage):
            role = "assistant"
            if message.tool_calls:
                content, extra = _with_calls(message, calls_in_content)
        elif isinstance(message, ToolMessage):
            role = "tool"
            extra = {"tool_call_id": message.tool_call_id}
        else:
            raise UnsupportedMessageError(
                f"messages[{i}]",
                f"is a {type(message).__name__}; ChatSpeculative accepts system, human, AI, tool and chat messages",
            )
        out.append({"role": role, "content": _as_parts(content), **extra})
    try:
        return validate_messages(out)
    except MessageError as exc:
        raise UnsupportedMessageError(exc.param, exc.problem, unsupported_field=exc.unsupported_field) from None


def _with_calls(message: AIMessage, calls_in_content: bool) -> tuple[str | list[Any], dict[str, Any]]:
    """An AIMessage's content without its tool-use blocks (the calls are in tool_calls), and its calls."""
    content: str | list[Any] = message.content
    if isinstance(content, list):  # Anthropic-style content repeats each call as a tool_use block
        content = [b for b in content if not (isinstance(b, dict) and b.get("type") in ("tool_use", "tool_call"))]
    calls = [{"id": c.get("id") or "", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)}}
             for c in message.tool_calls]
    if calls_in_content:
        written = "\n".join(call_text(c["name"], c["args"]) for c in message.tool_calls)
        text = content if isinstance(content, str) else "".join(
            b if isinstance(b, str) else str(b.get("text", "")) for b in content)
        content = f"{text}\n{written}" if text else written
    return content, {"tool_calls": calls}


def _as_parts(content: str | list[Any]) -> str | list[Any]:
    """LangChain content in OpenAI's form: bare strings become text parts, and text blocks lose LangChain's own
    keys (id, index, annotations); other blocks pass unchanged, for the validator to name."""
    if isinstance(content, str):
        return content
    parts: list[Any] = []
    for block in content:
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append({"type": "text", "text": block.get("text")})
        else:
            parts.append(block)
    return parts


# ---------------------------------------------------------------------------------------------------------------
# Batching. LangChain runs a chat model's batch() as one invoke() per input; to make it one batched call of the
# core, batch()/generate() (and their async forms) decode every prompt first, in one Decoder.generate call, and
# leave the results where the per-input _generate calls that LangChain then makes pick them up (keyed by prompt
# token ids and sampling parameters). LangChain's own path still runs callbacks, tracing, message ids and
# output_version handling for each input. Results nobody picks up (say, an input that a cache answered) are
# dropped with the batch.
# ---------------------------------------------------------------------------------------------------------------

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


class ChatSpeculative(SpeculativeParams, BaseChatModel):
    """A chat model decoded by spec-batch: exact speculative decoding of the target, through its chat template.

    Messages become the target's chat template (system, user, assistant, tool turns; text content only).
    `batch()` makes one batched call of the core. Each AIMessage carries `usage_metadata` (input, output and
    total tokens) and `response_metadata` with model_name, draft_name, finish_reason and speculative_stats
    (draft_tokens, accepted_tokens, acceptance_rate, tokens_per_step, ...). Structured output
    (`with_structured_output`, `response_format`) and tool calls (`bind_tools`) are decoded under a grammar, so
    they always parse (docs/structured-output.md). Inputs are text only.

    Example:
        ```python
        from langchain_spec import ChatSpeculative

        chat = ChatSpeculative(target="default", max_tokens=64)
        msg = chat.invoke("Name three primary colours.")
        msg.response_metadata["speculative_stats"]["acceptance_rate"]
        ```
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "spec-batch-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(self._ls_overrides(stop, kwargs))  # type: ignore[typeddict-item]
        return params

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Exact prompt length: the token ids of the target's chat template (with the generation prompt), the
        tools' description included."""
        plan = ToolPlan.from_kwargs({"tools": tools}) if tools else None
        return len(self._prompt_ids(self._get_decoder(), messages, plan))

    def bind_tools(
        self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with tools: answers are plain text or a call (AIMessage.tool_calls, with ids), written under
        a grammar of the call. tool_choice: "auto" (default), "any"/"required" (a call), a tool's name (a call of
        it) or "none". One call per answer. Tools are anything LangChain converts (functions, pydantic classes,
        BaseTools, OpenAI tool dicts)."""
        ToolPlan.from_kwargs({"tools": list(tools), "tool_choice": tool_choice})  # bad tools fail here, not later
        return self.bind(tools=list(tools), tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: Any = None,
        *,
        method: Method = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Parsed objects of a schema (a pydantic class: its instances; a TypedDict or JSON-schema dict: dicts).
        method "json_schema" (default) and "json_mode" decode under a grammar of the schema ("json_mode" without
        a schema: any JSON object); "function_calling" goes through bind_tools. include_raw=True gives
        {"raw": AIMessage, "parsed": ..., "parsing_error": ...}. strict=False keeps keys the schema leaves open."""
        if kwargs:
            raise InvalidParameterError(f"unsupported with_structured_output argument(s) {sorted(kwargs)}")
        return structured_output(self, schema, method=method, include_raw=include_raw, strict=strict)

    # --- prompt and results ---

    def _call(self, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[CallOptions, ToolPlan | None]:
        """A call's sampling options and tools; the tools' grammar becomes the call's response_format."""
        kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATE_ONLY}
        plan = ToolPlan.from_kwargs(kwargs)
        if plan is not None and plan.choice != "none":
            if kwargs.get("response_format") is not None or self.response_format is not None:
                raise InvalidParameterError("give tools or response_format, not both: a tool call has its own format")
            kwargs["response_format"] = plan.response_format()
        return self._options(stop, kwargs), plan

    @staticmethod
    def _prompt_ids(decoder: Any, messages: Sequence[BaseMessage], plan: ToolPlan | None = None) -> list[int]:
        template = getattr(getattr(decoder, "tokenizer", None), "chat_template", None) or ""
        dicts = messages_to_dicts(messages, calls_in_content="tool_calls" not in template)
        if plan is not None:
            dicts = plan.with_tools_prompt(dicts)
        return list(decoder.apply_chat_template(dicts))

    @staticmethod
    def _message(decoder: Any, result: GenerationResult, plan: ToolPlan | None = None) -> AIMessage:
        content, calls, invalid = parse_calls(result.text) if plan is not None else (result.text, [], [])
        return AIMessage(
            content=content,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            usage_metadata=usage(result.stats),  # type: ignore[arg-type]
            response_metadata=response_metadata(decoder, result.finish_reason, result.stats),
        )

    def _chunk(
        self, decoder: Any, text: str, finish_reason: Any, stats: Any, calls: CallStream | None = None
    ) -> ChatGenerationChunk | None:
        """A step's accepted text (with tools: content, or a call's tool_call_chunks); the last chunk carries
        usage and metadata. Steps with nothing new yet are skipped."""
        final = finish_reason is not None
        content, call_chunks = calls.feed(text, final) if calls is not None else (text, [])
        if not final:
            if not content and not call_chunks:
                return None
            return ChatGenerationChunk(message=AIMessageChunk(content=content, tool_call_chunks=call_chunks))
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content=content,
                tool_call_chunks=call_chunks,
                chunk_position="last",
                usage_metadata=usage(stats),  # type: ignore[arg-type]
                response_metadata=response_metadata(decoder, finish_reason, stats),
            )
        )

    @staticmethod
    def _take_prefetched(ids: list[int], options: CallOptions) -> GenerationResult | None:
        store = _prefetched.get()
        if store is None:
            return None
        outcome = store.take((tuple(ids), options.key))
        if isinstance(outcome, BaseException):
            # The batched call failed (a timeout, ...): every input of the batch raises that error, each its
            # own copy (several threads raise at once).
            raise copy.copy(outcome) from outcome
        return outcome

    # --- LangChain hooks ---

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        options, plan = self._call(stop, kwargs)
        decoder = self._get_decoder()
        ids = self._prompt_ids(decoder, messages, plan)
        result = self._take_prefetched(ids, options) or decode_one(decoder, ids, options)
        return ChatResult(generations=[ChatGeneration(message=self._message(decoder, result, plan))])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        options, plan = self._call(stop, kwargs)
        decoder = self._get_decoder()
        ids = self._prompt_ids(decoder, messages, plan)
        result = self._take_prefetched(ids, options) or await adecode_one(decoder, ids, options)
        return ChatResult(generations=[ChatGeneration(message=self._message(decoder, result, plan))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # LangChain itself reports each yielded chunk to the callbacks (on_llm_new_token).
        options, plan = self._call(stop, kwargs)
        decoder = self._get_decoder()
        ids = self._prompt_ids(decoder, messages, plan)
        calls = CallStream() if plan is not None else None
        done = self._take_prefetched(ids, options)
        if done is not None:  # a batch with streaming=True: decoded already, delivered as one chunk
            chunk = self._chunk(decoder, done.text, done.finish_reason, done.stats, calls)
            assert chunk is not None
            yield chunk
            return
        worker = StreamWorker(decoder, ids, options.params)
        for core_chunk in worker.iter(deadline_for(options.timeout), options.timeout):
            chunk = self._chunk(decoder, core_chunk.text, core_chunk.finish_reason, core_chunk.stats, calls)
            if chunk is not None:
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        options, plan = self._call(stop, kwargs)
        decoder = self._get_decoder()
        ids = self._prompt_ids(decoder, messages, plan)
        calls = CallStream() if plan is not None else None
        done = self._take_prefetched(ids, options)
        if done is not None:
            chunk = self._chunk(decoder, done.text, done.finish_reason, done.stats, calls)
            assert chunk is not None
            yield chunk
            return
        worker = StreamWorker(decoder, ids, options.params, loop=asyncio.get_running_loop())
        async for core_chunk in worker.aiter(deadline_for(options.timeout), options.timeout):
            chunk = self._chunk(decoder, core_chunk.text, core_chunk.finish_reason, core_chunk.stats, calls)
            if chunk is not None:
                yield chunk

    # --- batching: one core call for many prompts ---

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
        except Exception:  # noqa: BLE001 - reported per input by LangChain's path
            return None
        prompts: list[list[int]] = []
        for messages in message_lists:
            try:
                prompts.append(self._prompt_ids(decoder, messages, plan))
            except Exception:  # noqa: BLE001 - that input raises the same error on its own path
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
            except Exception as exc:  # noqa: BLE001 - handed to the inputs by _store
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
            except Exception as exc:  # noqa: BLE001 - handed to the inputs by _store
                store = self._store(plan, exc)
        with _visible(store):
            yield

    def _input_messages(self, inputs: Sequence[LanguageModelInput]) -> list[list[BaseMessage]]:
        try:
            return [self._convert_input(x).to_messages() for x in inputs]
        except Exception:  # noqa: BLE001 - LangChain's path reports the bad input
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
        call_kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATE_ONLY}
        with self._prefetch(messages, stop, call_kwargs):
            return super().generate(messages, stop=stop, callbacks=callbacks, **kwargs)

    async def agenerate(
        self,
        messages: list[list[BaseMessage]],
        stop: list[str] | None = None,
        callbacks: Callbacks = None,
        **kwargs: Any,
    ) -> LLMResult:
        call_kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATE_ONLY}
        async with self._aprefetch(messages, stop, call_kwargs):
            return await super().agenerate(messages, stop=stop, callbacks=callbacks, **kwargs)


# Keyword arguments of BaseChatModel.generate that are LangChain's, not the model's.
_GENERATE_ONLY = frozenset(
    {"tags", "metadata", "run_name", "run_id", "ls_structured_output_format", "structured_output_format"}
)
