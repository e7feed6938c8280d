"""LangChain models on the spec-batch core: SpeculativeLLM (text completion) and ChatSpeculative (chat)."""
from ._core import GenerationTimeout, clear_decoder_cache
from .chat_models import ChatSpeculative, UnsupportedMessageError
from .llms import SpeculativeLLM

__all__ = [
    "SpeculativeLLM",
    "ChatSpeculative",
    "GenerationTimeout",
    "UnsupportedMessageError",
    "clear_decoder_cache",
]
