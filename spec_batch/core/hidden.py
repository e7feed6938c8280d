"""The target's hidden states from a forward that runs anyway (prefill, verify), for drafters that read them.

A forward hook on the final norm captures the last hidden state (what the LM head reads: EAGLE's feature)
without asking the model for every layer's states (output_hidden_states keeps all of them: at a long prefill
that is tens of layers x rows x tokens of memory for nothing).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def final_norm(model: Any) -> torch.nn.Module:
    """The module whose output is the target's last hidden state (Llama family: model.model.norm)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: no final norm to read hidden states from (Llama-family targets only)")
    return norm


@contextlib.contextmanager
def capture_hidden(model: Any, wanted: bool) -> Iterator[list[torch.Tensor]]:
    """Within the block, the target's forward appends its last hidden states [B, n, H] to the yielded list
    (nothing when not wanted)."""
    out: list[torch.Tensor] = []
    if not wanted:
        yield out
        return
    handle = final_norm(model).register_forward_hook(lambda _m, _i, o: out.append(o[0] if isinstance(o, tuple) else o))
    try:
        yield out
    finally:
        handle.remove()


def wants_hidden(drafter: Any) -> bool:
    """Whether a drafter reads the target's hidden states (`observe_hidden`); other drafters ignore them."""
    return bool(getattr(drafter, "wants_hidden", False))
