"""Resolving, loading and caching models, chat messages and templates, and building decoders over them.

resolve (what a model name refers to) -> load (model + tokenizer on a device) -> factory (decoders, and the
one per-process cache of models and decoders); chat validates chat messages and applies chat templates.

The names are imported on first use (PEP 562): validating a batch file's chat messages (`chat`) or resolving
a model name must not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_LAZY = {
    "DecoderSpec": ".decoder_spec",
    "MessageError": ".chat",
    "apply_chat_template": ".chat",
    "validate_messages": ".chat",
    "build_decoder": ".factory",
    "clear_cache": ".factory",
    "load_decoder": ".factory",
    "shared_decoder": ".factory",
    "shared_model": ".factory",
    "resolve_spec": ".resolve",
}

if TYPE_CHECKING:
    from .chat import MessageError, apply_chat_template, validate_messages
    from .decoder_spec import DecoderSpec
    from .factory import build_decoder, clear_cache, load_decoder, shared_decoder, shared_model
    from .resolve import resolve_spec

__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(_LAZY)
