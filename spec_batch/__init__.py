"""spec-batch: exact, batched speculative decoding on Hugging Face models."""
from .decoder import Decoder, load_decoder
from .errors import (
    ChatTemplateError,
    DefaultModelMissingError,
    IncompatibleModelsError,
    InvalidParameterError,
    PromptTooLongError,
    SpecBatchError,
    UnknownModelError,
)
from .outputs import GenerationResult, RequestStats, StreamChunk
from .sampling import SamplingParams

__all__ = [
    "Decoder",
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
