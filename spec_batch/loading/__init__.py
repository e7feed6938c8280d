"""Resolving, loading and caching models, chat templates, and building decoders over them."""
from .factory import build_decoder, load_decoder

__all__ = ["build_decoder", "load_decoder"]
