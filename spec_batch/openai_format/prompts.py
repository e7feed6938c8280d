"""A request's prompt as the decoder takes it, and the error code of a prompt that cannot be built: shared by the
jobs (stored batch lines) and the online server (request bodies)."""

from __future__ import annotations

from typing import Any

from ..core.decoder_like import DecoderLike
from ..errors import ChatTemplateError, SpecBatchError
from .body import CHAT


def build_prompt(decoder: DecoderLike, endpoint: str, prompt: Any) -> str | list[int]:
    """The decoder's input for a request's prompt: chat messages through the target's chat template; a completion's
    text or token ids as they are."""
    if endpoint == CHAT:
        return decoder.apply_chat_template(prompt)
    return prompt


def prompt_list(endpoint: str, prompt: Any) -> list[Any]:
    """The prompts of a request, in order: chat messages are one prompt; a completion's prompt is one string or one
    list of token ids, or several (a list of strings, a list of token-id lists: openai_format.fields._prompt)."""
    if endpoint == CHAT or isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt]


def prompt_error_code(exc: BaseException) -> str:
    """OpenAI's error code for a prompt that could not be built."""
    if isinstance(exc, ChatTemplateError):
        return "chat_template_error"
    if isinstance(exc, SpecBatchError):
        return "invalid_request"
    return "internal_error"


__all__ = ["build_prompt", "prompt_error_code", "prompt_list"]
