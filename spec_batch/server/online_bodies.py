"""Online response bodies in OpenAI's shapes: a whole chat.completion / text_completion, and the chunks of a
streamed one (chat.completion.chunk; text_completion chunks for /v1/completions).

Choices and usage come from spec_batch.openai_format.render, the same renderers as the batch output lines, so an
online answer and the batch line of the same request have the same body (ids and `created` aside).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from spec_batch.core.outputs import GenerationResult, RequestStats, TokenLogprob
from spec_batch.jobs.choices import Choices
from spec_batch.openai_format import CHAT
from spec_batch.openai_format.render import chat_choice, completion_choice, token_records, usage


@dataclass
class Reply:
    """What every body of one request shares: its id, time, the served model's name and how to render."""

    endpoint: str
    model: str
    drafter: str
    tokenizer: Any
    tools: bool = False  # chat with tools: an answer that is a call becomes message.tool_calls
    per_prompt: int | None = None  # choices of each prompt (the body's n) when a completion has several prompts
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    @property
    def chat(self) -> bool:
        return self.endpoint == CHAT

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def records(self, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
        return token_records(self.tokenizer, logprobs)

    # ---------------------------------------------------------------- a whole answer

    def choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        records = self.records(result.logprobs)
        if self.chat:
            return chat_choice(
                index,
                result.text,
                result.finish_reason,
                records,
                tools=self.tools,
                call_id=f"call_{self.id[-12:]}_{index}",
            )
        return completion_choice(index, result.text, result.finish_reason, records)

    def body(self, results: list[GenerationResult]) -> dict[str, Any]:
        return {
            **self._envelope("chat.completion" if self.chat else "text_completion"),
            "choices": [self.choice(i, r) for i, r in enumerate(results)],
            "usage": self.usage(results),
        }

    def usage(self, results: list[GenerationResult]) -> dict[str, Any]:
        """The request's usage: every choice's tokens and statistics (the prompt once), as a batch line's."""
        gathered = Choices(self.tokenizer)
        gathered.expect(0, len(results), self.per_prompt)
        merged: GenerationResult | None = None
        for i, r in enumerate(results):
            out = gathered.add(0, i, r)
            merged = out[0] if out is not None else merged
        stats = merged.stats if merged is not None else RequestStats()
        return usage(stats.to_dict(), self.drafter)

    # ---------------------------------------------------------------- streamed chunks

    def chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        role: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice's delta."""
        records = self.records(logprobs) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice = {
                "index": index,
                "delta": delta,
                "finish_reason": finish_reason,
                "logprobs": None if records is None else {"content": records, "refusal": None},
            }
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        choice = completion_choice(index, text or "", finish_reason, records)
        return {**self._envelope("text_completion"), "choices": [choice]}

    def tool_call_chunk(self, index: int, result: GenerationResult) -> dict[str, Any]:
        """The end of a streamed chat answer with tools (its text was held back): the calls, or the text."""
        message = self.choice(index, result)["message"]
        calls = message.get("tool_calls")
        if not calls:
            return self.chunk(index, text=result.text, finish_reason=result.finish_reason)
        deltas = [{"index": k, **call} for k, call in enumerate(calls)]
        return self.chunk(index, tool_calls=deltas, finish_reason="tool_calls")

    def usage_chunk(self, results: list[GenerationResult]) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices and the request's usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": self.usage(results)}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")
