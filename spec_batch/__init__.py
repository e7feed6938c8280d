"""spec-batch: exact, batched speculative decoding on Hugging Face models.

The names below are imported on first use (PEP 562), so `import spec_batch.store` or a CLI command that only
reads the database does not pay for torch and transformers (seconds at every `spec-batch status`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .errors import (
    ChatTemplateError,
    DefaultModelMissingError,
    IncompatibleModelsError,
    InvalidParameterError,
    PromptTooLongError,
    SpecBatchError,
    UnknownModelError,
)

_LAZY = {
    "Decoder": ".core.decoder",
    "JobMemory": ".core.drafting.job_memory",
    "load_decoder": ".loading",
    "GenerationResult": ".core.outputs",
    "RequestStats": ".core.outputs",
    "StreamChunk": ".core.outputs",
    "TokenLogprob": ".core.outputs",
    "SamplingParams": ".core.params",
}

if TYPE_CHECKING:
    from .core.decoder import Decoder
    from .core.drafting.job_memory import JobMemory
    from .core.outputs import GenerationResult, RequestStats, StreamChunk, TokenLogprob
    from .core.params import SamplingParams
    from .loading import load_decoder

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "ChatTemplateError",
    "Decoder",
    "DefaultModelMissingError",
    "GenerationResult",
    "IncompatibleModelsError",
    "InvalidParameterError",
    "JobMemory",
    "PromptTooLongError",
    "RequestStats",
    "SamplingParams",
    "SpecBatchError",
    "StreamChunk",
    "TokenLogprob",
    "UnknownModelError",
    "load_decoder",
]
