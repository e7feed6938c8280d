"""LangChain models on the spec-batch core: SpeculativeLLM (text completion) and ChatSpeculative (chat)."""

from spec_batch.loading import clear_cache as clear_decoder_cache

from ._core import GenerationTimeout
from .chat_models import ChatSpeculative, UnsupportedMessageError
from .llms import SpeculativeLLM

__all__ = [
    "ChatSpeculative",
    "GenerationTimeout",
    "SpeculativeLLM",
    "UnsupportedMessageError",
    "clear_decoder_cache",
]
