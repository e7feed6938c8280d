"""Errors a user can cause. Each message names the offending value and says what to do."""

from __future__ import annotations


class SpecBatchError(Exception):
    """Base class of every error spec-batch raises on purpose."""


class UnknownModelError(SpecBatchError):
    """A model name that is not an alias, a local directory, a GGUF file or a cached hub id."""


class DefaultModelMissingError(SpecBatchError):
    """The package that ships the default model's GGUF file is not installed."""


class IncompatibleModelsError(SpecBatchError):
    """A draft model whose tokenizer or vocabulary does not match the target's."""


class ChatTemplateError(SpecBatchError):
    """Chat messages for a model that has no chat template, or malformed messages."""


class PromptError(SpecBatchError):
    """An error about one prompt of a call. str() names the prompt by `prompt_index`, its place among the call's
    prompts (None: not one of a call's); `detail` says the same of "the prompt", for a caller that names it
    otherwise (a job names a request by its line and custom_id)."""

    def __init__(self, message: str, *, prompt_index: int | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.prompt_index = prompt_index
        self.detail = message if detail is None else detail


class PromptTooLongError(PromptError):
    """A prompt plus its max_new_tokens does not fit the model's context."""


class InvalidParameterError(SpecBatchError, ValueError):
    """An unknown or out-of-range sampling or decoder parameter."""


class InvalidPromptError(InvalidParameterError, PromptError):
    """A prompt that is not one: not text or token ids, empty, or naming token ids outside the vocabulary."""
