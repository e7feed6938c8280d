"""ChatSpeculative: a LangChain chat model (BaseChatModel) on the spec-batch core, using the target's chat template.

Its jobs live beside it: messages.py (LangChain messages -> chat messages), batching.py (batch() as one core
call), structured.py (with_structured_output), tools.py (bind_tools), _core.py (options, deadlines, metadata)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from pydantic import ConfigDict

from spec_batch import GenerationResult, InvalidParameterError

from ._base import SpeculativeParams
from ._core import CallOptions, StreamWorker, adecode_one, deadline_for, decode_one, response_metadata, usage
from .batching import GENERATE_ONLY, PrefetchingBatches, take_prefetched
from .messages import UnsupportedMessageError, messages_to_dicts
from .structured import Method, structured_output
from .tools import CallStream, ToolPlan, parse_calls

__all__ = ["ChatSpeculative", "UnsupportedMessageError", "messages_to_dicts"]


class ChatSpeculative(SpeculativeParams, PrefetchingBatches, BaseChatModel):
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
        kwargs = {k: v for k, v in kwargs.items() if k not in GENERATE_ONLY}
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
        result = take_prefetched(ids, options) or decode_one(decoder, ids, options)
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
        result = take_prefetched(ids, options) or await adecode_one(decoder, ids, options)
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
        done = take_prefetched(ids, options)
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
        done = take_prefetched(ids, options)
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
