"""Attention for models that run on the CPU: exact across step widths and batches, and grouped-query attention
without copying the KV cache.

**Native (the default where a C++ compiler is found).** `spec_batch_native` runs kernels/cpu_attention.cpp: each
query reads only its visible key columns, in column order, with fixed reduction splits, so its numbers are the same
bits at every step width, key length and batch by construction, in the compute dtype (fp32 or bf16, fp32
accumulation). The KV cache stays in the model's dtype. `SPEC_BATCH_COMPILE=off` (or no compiler) selects the
float64 path below, which buys the same guarantee at a higher price. The two paths are each exact, but their bits
differ from each other (docs/weights.md).

**Exact.** Speculation equals plain decoding token for token only if a token's numbers do not depend on how many
tokens its forward computes or which rows share it. The linear layers here guarantee that per row (cpu_linear.py,
quant_linear.py), but attention sums over the key columns, and torch's kernels block and vectorize those sums by the
step's key length (a verify step of 9 tokens sees 8 more, masked, columns than a one-token step): on the default
model the logits of the same token then differed by ~4e-5 in fp32 and, where int4/int8 kernels round their inputs
to bf16 (which amplifies a last-bit difference into a bf16 step), by up to 0.3, which flipped greedy tokens in most
speculative outputs. So attention computes in float64 on the CPU: summation order then moves results by ~1e-16,
far below the float32 (or bf16) rounding of the output, and the logits of a token are the same bit for bit at every
width and batch (tests/loading/test_exact_attention.py). The KV cache is kept in float64 (core/kv/kv_batch.py reads
`spec_batch_kv_dtype`), so no step casts it. It costs ~2x the attention's own time (docs/weights.md).

**Grouped-query attention.** Hugging Face's `sdpa` attention handles grouped-query attention (SmolLM2: 9 query
heads share 3 key/value heads) in one of two ways: a single query token is folded onto the key/value heads (the
query heads that share a key/value head become that head's queries, so the cache is read once per key/value head),
but a forward of several tokens with a mask (every verify step of speculative decoding) copies the whole cache into
one key/value head per query head first (`repeat_kv`): at batch 8 that copy cost ~55 ms of a ~110 ms step on the
default model. So this registers `spec_batch_sdpa`: `sdpa`, with multi-token masked forwards on the CPU folded the
same way. Folding beats torch's own `enable_gqa=True` (used here before), whose CPU kernel reads the cache once per
query head: on the verify steps of real batch-8 jobs attention took 25-30% less time (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import AttentionInterface, AttentionMaskInterface, sdpa_attention_forward, sdpa_mask

NAME = "spec_batch_sdpa"
NATIVE = "spec_batch_native"
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


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
    dtype, cpu = query.dtype, query.device.type == "cpu"
    if cpu:  # float64: a token's numbers do not depend on its step's width or batch
        query, key, value = query.to(torch.float64), key.to(torch.float64), value.to(torch.float64)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(torch.float64)
    masked_steps = attention_mask is not None and attention_mask.shape[1] == 1 and query.shape[2] > 1
    if cpu and groups > 1 and plain and masked_steps:
        return _folded(query, key, value, attention_mask, scaling, dropout).to(dtype), None
    out, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )
    return out.to(dtype), weights


def _folded(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None, dropout: float
) -> torch.Tensor:
    """query [B, H, n, D] on key/value [B, Hkv, L, D] with mask [B or 1, 1, n, L] -> [B, n, H, D]: the H / Hkv query
    heads that share a key/value head are stacked as n * H / Hkv queries of that head (each with its token's mask
    row), so each key/value head is read once."""
    rows, heads, n, dim = query.shape
    group = heads // key.shape[1]
    stacked_mask = mask.expand(rows, 1, n, mask.shape[-1]).repeat(1, 1, group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, key.shape[1], group * n, dim),
        key,
        value,
        attn_mask=stacked_mask,
        dropout_p=dropout,
        scale=scale,
    )
    return out.view(rows, heads, n, dim).transpose(1, 2).contiguous()


def native_forward(
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
    """query [B, H, n, D] on key/value [B, Hkv, L, D] -> [B, n, H, D] through the native kernel."""
    special = any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "sinks", "s_aux"))
    if special or dropout or query.device.type != "cpu" or query.dtype not in NATIVE_DTYPES:
        raise NotImplementedError("spec_batch_native attention: plain CPU attention in fp32/bf16 only")
    visible, bias = _visible(attention_mask, query.shape[2], key.shape[2], query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.spec_batch.attend(query, key, value, visible, bias, scale), None


def _visible(mask: torch.Tensor | None, n: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bool visibility [B|1, 1, n, L] and an additive float bias (empty when there is none)."""
    none = torch.empty(0)
    if mask is None:  # causal over the whole cache: query i sees columns up to L - n + i
        cols = torch.arange(length, device=device)
        return (cols.unsqueeze(0) <= torch.arange(length - n, length, device=device).unsqueeze(1)).view(
            1, 1, n, length
        ), none
    mask = mask[..., -n:, :length]
    if mask.dtype == torch.bool:
        return mask, none
    visible = mask > torch.finfo(mask.dtype).min / 2
    bias = mask.masked_fill(~visible, 0)
    return visible, (bias.float() if bool(bias.any()) else none)


AttentionInterface.register(NAME, sdpa_gqa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(NATIVE, native_forward)
AttentionMaskInterface.register(NATIVE, sdpa_mask)


def use_gqa_attention(model: Any, native: bool = False) -> bool:
    """Switches a CPU model from `sdpa` to `spec_batch_native` (native: the kernels are loaded and the model
    computes in fp32 or bf16) or `spec_batch_sdpa` (True), or leaves it as it is (False)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or model.device.type != "cpu":
        return False
    name = NATIVE if native and model.dtype in NATIVE_DTYPES else NAME
    try:
        model.set_attn_implementation(name)
    except (ValueError, NotImplementedError, AttributeError):  # a model class without attention backends: as it is
        return False
    if model.config._attn_implementation != name:
        return False
    # core/kv/kv_batch.py keeps the cache in this dtype: float64 for the float64 path (no cast per step)
    model.spec_batch_kv_dtype = None if name == NATIVE else torch.float64
    return True


def attention_kind(model: Any) -> str:
    """What a loaded model's attention is: native | float64 | the Hugging Face implementation's name."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return {NATIVE: "native", NAME: "float64"}.get(name, str(name))
