"""Resolving, loading and caching models, chat messages and templates, and building decoders over them.

resolve (what a model name refers to) -> load (model + tokenizer on a device) -> factory (decoders, and the
one per-process cache of models and decoders); chat validates chat messages and applies chat templates.
"""
from .chat import MessageError, apply_chat_template, validate_messages
from .factory import build_decoder, clear_cache, load_decoder, shared_decoder, shared_model
from .resolve import resolve_spec

__all__ = [
    "MessageError",
    "apply_chat_template",
    "build_decoder",
    "clear_cache",
    "load_decoder",
    "resolve_spec",
    "shared_decoder",
    "shared_model",
    "validate_messages",
]
