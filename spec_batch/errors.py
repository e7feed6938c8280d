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


class PromptTooLongError(SpecBatchError):
    """A prompt plus its max_new_tokens does not fit the model's context."""


class InvalidParameterError(SpecBatchError, ValueError):
    """An unknown or out-of-range sampling or decoder parameter."""
