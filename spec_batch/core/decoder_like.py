"""What jobs/ and the server decode through: `Decoder`, the engine's `EngineDecoder`, the batch runner's stoppable
wrapper and the tests' fake decoder all have this shape. Jobs never need more; code that does (head training
reads the target model) takes a `Decoder`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .drafting.job_memory import JobMemory
from .inputs import Prompt
from .outputs import GenerationResult
from .params import SamplingParams


@runtime_checkable
class DecoderLike(Protocol):
    """generate() with Decoder.generate's contract, the plain decoder the baseline is measured on, the prompt
    builder's chat template, and the attributes jobs read to label, check and route their requests."""

    tokenizer: Any
    target_name: str
    draft_name: str
    max_context: int
    vocab_size: int
    uses_memory: bool  # its drafter drafts from a job memory (jobs warm one only then)

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
    ) -> list[GenerationResult]: ...

    def without_speculation(self) -> DecoderLike: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...


__all__ = ["DecoderLike"]
