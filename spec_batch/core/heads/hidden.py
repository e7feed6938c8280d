"""The target's hidden states from a forward that runs anyway (prefill, verify), for drafters that read them.

A forward hook on the final norm captures the last hidden state (what the LM head reads: EAGLE's feature)
without asking the model for every layer's states (output_hidden_states keeps all of them: at a long prefill
that is tens of layers x rows x tokens of memory for nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..drafting.drafters import ReadsHidden


def final_norm(model: Any) -> torch.nn.Module:
    """The module whose output is the target's last hidden state (Llama family: model.model.norm)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(
            f"{type(model).__name__}: no final norm to read hidden states from (Llama-family targets only)"
        )
    return norm


@contextlib.contextmanager
def capture_hidden(model: Any, wanted: bool, layers: Sequence[int] | None = None) -> Iterator[list[torch.Tensor]]:
    """Within the block, each target forward appends its hidden states to the yielded list (nothing when not
    wanted): the last hidden state [B, n, H], or with `layers` (Hugging Face hidden_states indices: the input of
    layer i, 0 = the embeddings) those states side by side [B, n, H x len(layers)] (EAGLE-3)."""
    out: list[torch.Tensor] = []
    if not wanted:
        yield out
        return
    first = lambda o: o[0] if isinstance(o, tuple) else o
    if not layers:
        handles = [final_norm(model).register_forward_hook(lambda _m, _i, o: out.append(first(o)))]
    else:
        parts: dict[int, torch.Tensor] = {}

        def keep(i: int):
            def hook(_m, _i, o) -> None:
                parts[i] = first(o)
                if len(parts) == len(set(layers)):
                    out.append(torch.cat([parts[j] for j in layers], dim=-1))
                    parts.clear()

            return hook

        decoder = model.get_decoder()
        handles = [
            (decoder.embed_tokens if i == 0 else decoder.layers[i - 1]).register_forward_hook(keep(i))
            for i in sorted(set(layers))
        ]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def hidden_reader(drafter: Any) -> ReadsHidden | None:
    """The drafter, when it reads the target's hidden states now (`ReadsHidden`, wants_hidden); else None."""
    # wants_hidden first: a runtime protocol's isinstance walks its members (~25 us, twice a step)
    return drafter if getattr(drafter, "wants_hidden", False) and isinstance(drafter, ReadsHidden) else None


def wants_hidden(drafter: Any) -> bool:
    """Whether a drafter reads the target's hidden states (`observe_hidden`); other drafters ignore them."""
    return hidden_reader(drafter) is not None


def hidden_layers(drafter: Any) -> Sequence[int] | None:
    """The target layers a drafter reads (None: the last hidden state)."""
    return drafter.hidden_layers if isinstance(drafter, ReadsHidden) else None
