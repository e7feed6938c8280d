"""SpeculativeLLM: a LangChain text-completion model (BaseLLM) on the spec-batch core."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.language_models.base import LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from spec_batch import GenerationResult

from ._base import SpeculativeParams
from ._core import (
    StreamWorker,
    adecode_many,
    adecode_one,
    deadline_for,
    decode_many,
    decode_one,
    response_metadata,
    usage,
)


class SpeculativeLLM(SpeculativeParams, BaseLLM):
    """A text-completion LLM decoded by spec-batch: exact speculative decoding of the target model.

    The prompt string goes to the target as it is (no chat template; use ChatSpeculative for chat).
    `batch()` / `generate()` with many prompts make one batched call of the core. Each generation's
    `generation_info` carries model_name, draft_name, finish_reason, usage_metadata and speculative_stats;
    `llm_output["token_usage"]` sums the batch's tokens.

    Example:
        ```python
        from langchain_spec import SpeculativeLLM

        llm = SpeculativeLLM(target="default", draft="ngram", max_tokens=32)
        llm.invoke("The capital of France is")
        ```
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "spec-batch"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(self._ls_overrides(stop, kwargs))  # type: ignore[typeddict-item]
        return params

    # --- results ---

    def _generation(self, decoder: Any, result: GenerationResult) -> Generation:
        return Generation(text=result.text, generation_info=self._info(decoder, result.finish_reason, result.stats))

    def _info(self, decoder: Any, finish_reason: Any, stats: Any) -> dict[str, Any]:
        info = response_metadata(decoder, finish_reason, stats)
        info["usage_metadata"] = usage(stats)
        return info

    def _llm_result(self, decoder: Any, generations: list[Generation]) -> LLMResult:
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for g in generations:
            u = (g.generation_info or {}).get("usage_metadata") or {}
            totals["prompt_tokens"] += u.get("input_tokens", 0)
            totals["completion_tokens"] += u.get("output_tokens", 0)
            totals["total_tokens"] += u.get("total_tokens", 0)
        return LLMResult(
            generations=[[g] for g in generations],
            llm_output={"model_name": decoder.target_name, "token_usage": totals},
        )

    def _wants_stream(self, prompts: list[str], kwargs: dict[str, Any]) -> bool:
        # One prompt with streaming on: decode through _stream so callbacks see every token. Many prompts stay
        # one batched call (LangChain gives _generate only the first prompt's run manager).
        return len(prompts) == 1 and bool(kwargs.get("stream", self.streaming))

    # --- LangChain hooks ---

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        options = self._options(stop, kwargs)
        decoder = self._get_decoder()
        if self._wants_stream(prompts, kwargs):
            merged: GenerationChunk | None = None
            for chunk in self._stream(prompts[0], stop=stop, run_manager=run_manager, **kwargs):
                merged = chunk if merged is None else merged + chunk
            assert merged is not None
            return self._llm_result(decoder, [Generation(text=merged.text, generation_info=merged.generation_info)])
        if len(prompts) == 1:
            results = [decode_one(decoder, prompts[0], options)]
        else:
            results = decode_many(decoder, prompts, options, self.batch_size)
        return self._llm_result(decoder, [self._generation(decoder, r) for r in results])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        options = self._options(stop, kwargs)
        decoder = self._get_decoder()
        if self._wants_stream(prompts, kwargs):
            merged: GenerationChunk | None = None
            async for chunk in self._astream(prompts[0], stop=stop, run_manager=run_manager, **kwargs):
                merged = chunk if merged is None else merged + chunk
            assert merged is not None
            return self._llm_result(decoder, [Generation(text=merged.text, generation_info=merged.generation_info)])
        if len(prompts) == 1:
            results = [await adecode_one(decoder, prompts[0], options)]
        else:
            results = await adecode_many(decoder, prompts, options, self.batch_size)
        return self._llm_result(decoder, [self._generation(decoder, r) for r in results])

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        options = self._options(stop, kwargs)
        decoder = self._get_decoder()
        worker = StreamWorker(decoder, prompt, options.params)
        for core_chunk in worker.iter(deadline_for(options.timeout), options.timeout):
            chunk = self._chunk(decoder, core_chunk)
            if chunk is None:
                continue
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        options = self._options(stop, kwargs)
        decoder = self._get_decoder()
        worker = StreamWorker(decoder, prompt, options.params, loop=asyncio.get_running_loop())
        async for core_chunk in worker.aiter(deadline_for(options.timeout), options.timeout):
            chunk = self._chunk(decoder, core_chunk)
            if chunk is None:
                continue
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunk(self, decoder: Any, core_chunk: Any) -> GenerationChunk | None:
        """A step's accepted text; the last chunk also carries the metadata. Steps with no text yet are skipped."""
        if core_chunk.finish_reason is None:
            return GenerationChunk(text=core_chunk.text) if core_chunk.text else None
        return GenerationChunk(
            text=core_chunk.text,
            generation_info=self._info(decoder, core_chunk.finish_reason, core_chunk.stats),
        )
