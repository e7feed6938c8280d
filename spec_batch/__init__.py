"""spec-batch: exact, batched speculative decoding on Hugging Face models."""
from .core.decoder import Decoder
from .core.job_memory import JobMemory
from .loading import load_decoder
from .errors import (
    ChatTemplateError,
    DefaultModelMissingError,
    IncompatibleModelsError,
    InvalidParameterError,
    PromptTooLongError,
    SpecBatchError,
    UnknownModelError,
)
from .core.outputs import GenerationResult, RequestStats, StreamChunk
from .core.sampling import SamplingParams

__all__ = [
    "Decoder",
    "JobMemory",
    "load_decoder",
    "SamplingParams",
    "GenerationResult",
    "RequestStats",
    "StreamChunk",
    "SpecBatchError",
    "UnknownModelError",
    "DefaultModelMissingError",
    "IncompatibleModelsError",
    "ChatTemplateError",
    "PromptTooLongError",
    "InvalidParameterError",
]
