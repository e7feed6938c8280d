"""Grouped-query attention without copying the KV cache, for models that run on the CPU.

Hugging Face's `sdpa` attention handles grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads)
in one of two ways: a single query token is folded onto the key/value heads, but a forward of several tokens
with a mask (every verify step of speculative decoding) copies the whole cache into one key/value head per query
head first (`repeat_kv`). At batch 8 that copy cost ~55 ms of a ~110 ms step on the default model, so a verify
of 2 tokens cost 1.5x one of 1 token. torch's SDPA takes `enable_gqa=True` instead, with the same result bit
for bit on the CPU; Hugging Face enables it only without a mask, because CUDA then falls back to the math kernel.
So this registers `spec_batch_sdpa`: `sdpa`, with `enable_gqa` for masked multi-token forwards on the CPU.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "spec_batch_sdpa"


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    plain = not any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))
    if groups > 1 and plain and attention_mask is not None and query.shape[2] > 1 and query.device.type == "cpu":
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


AttentionInterface.register(NAME, sdpa_gqa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_gqa_attention(model: Any) -> bool:
    """Switches a CPU model from `sdpa` to `spec_batch_sdpa` (True), or leaves it as it is (False)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or model.device.type != "cpu":
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, NotImplementedError, AttributeError):  # a model class without attention backends: as it is
        return False
    return model.config._attn_implementation == NAME
