"""Our own forward for the Llama family (Llama, SmolLM2, Mistral and Qwen2 without sliding windows).

Hugging Face's forward spends much of a small model's decode step outside arithmetic: per layer, a decorated
module call chain, keyword plumbing, the attention-interface lookup, the cache's per-layer dispatch and the fused
projections' per-part bookkeeping; per forward, a 4-D mask built by masking_utils. This forward runs the same
layers over the same loaded modules (no second copy of any weight) in one flat loop:

- the fused q/k/v and gate/up groups are called once each (loading/fused_projections.py),
- the visibility of each query is built once per forward, as a bool [B, 1, n, L], and the native attention kernel
  reads it directly (loading/kernels/cpu_attention.cpp),
- norms, rotary embeddings and the activation are the model's own functions, called in Hugging Face's order.

**The same bits as Hugging Face's forward.** Every operator is the one Hugging Face runs, on the same inputs in the
same order, and the native kernel's result depends only on which columns a query sees, never on how the mask was
written: logits are identical bit for bit (tests/loading/test_llama_forward.py checks it at every width, batch,
tree mask and precision). So the forward kind never changes an output and needs no place in a job's routing.

It applies where `applies_to` says: a Llama-family model on the CPU whose attention is the native kernel. Hidden-
state hooks on the final norm fire as before (core/heads/hidden.py); a model with hooks on its layers or embeddings
(EAGLE-3 features) and calls with extra model arguments use Hugging Face's forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from .cpu_attention import attention_kind

FORWARD_CHOICES = ("auto", "own", "hf")
FAMILY = ("llama", "mistral", "qwen2")
_NO_BIAS = torch.empty(0)


@dataclass
class ForwardOutput:
    """What callers read from a forward (Hugging Face's CausalLMOutputWithPast has more fields)."""

    logits: torch.Tensor
    past_key_values: Any = None


def why_not(model: Any) -> str | None:
    """None if our forward applies to the model; otherwise why not."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        return f"model type {kind!r} is not of the Llama family {FAMILY}"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "layers other than full attention"
    if attention_kind(model) != "native":
        return f"attention {attention_kind(model)!r} (ours needs the native kernels: SPEC_BATCH_COMPILE)"
    attn = model.model.layers[0].self_attn
    if any(hasattr(attn, name) for name in ("q_norm", "k_norm")):
        return "per-head q/k norms"
    return None


class LlamaForward:
    """A callable with the keyword signature KVBatch uses for a model call, over `model`'s own modules."""

    def __init__(self, model: Any) -> None:
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, list(inner.layers), inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, model.lm_head
        module = sys.modules[type(self.layers[0].self_attn).__module__]
        self.apply_rotary, self.rotate_half = module.apply_rotary_pos_emb, module.rotate_half
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling

    def usable(self, model_kwargs: dict[str, Any]) -> bool:
        """Whether this call can run here: no extra model arguments and no hooks that expect HF's module calls."""
        if model_kwargs:
            return False
        return not (self.embed._forward_hooks or any(layer._forward_hooks for layer in self.layers))

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: Any,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> ForwardOutput:
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, position_ids)
        visible = _visible(attention_mask, input_ids.shape[1], past_key_values.get_seq_length())
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, (cos, sin), visible, past_key_values)
        x = self.norm(x)  # through __call__: core/heads/hidden.py's hook reads it
        kept = x[:, -logits_to_keep:] if logits_to_keep else x
        return ForwardOutput(logits=self.lm_head(kept), past_key_values=past_key_values)

    def _layer(self, index: int, layer: Any, x: torch.Tensor, rotary: tuple, visible: torch.Tensor, cache: Any):
        rows, width, _ = x.shape
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm.forward(x)
        q, k, v = self._queries_keys_values(attn, h, rotary)
        keys, values = cache.update(k, v, index)
        out = torch.ops.spec_batch.attend(q, keys, values, visible, _NO_BIAS, self.scale)  # [B, n, H, D]
        x = x + attn.o_proj(out.reshape(rows, width, -1).contiguous())
        h = layer.post_attention_layernorm.forward(x)
        gate, up = _projections(mlp, ("gate_proj", "up_proj"), "gate_up_proj", h)
        return x + mlp.down_proj(mlp.act_fn(gate) * up)

    def _queries_keys_values(self, attn: Any, h: torch.Tensor, rotary: tuple) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, heads, n, D] with the rotary embedding applied to q and k. With a fused q/k/v group, q's and
        k's heads rotate in one pass over the group's output: elementwise, so the same bits as one pass each."""
        rows, width, _ = h.shape
        group = getattr(attn, "qkv_proj", None)
        if group is None:
            shape = (rows, width, -1, self.head_dim)
            q, k, v = (getattr(attn, name)(h).view(shape).transpose(1, 2) for name in ("q_proj", "k_proj", "v_proj"))
            return (*self.apply_rotary(q, k, *rotary), v)
        heads = group.fused(h).view(rows, width, -1, self.head_dim)  # [B, n, Hq + 2 Hkv, D]
        nq, nk = group.sizes[0] // self.head_dim, group.sizes[1] // self.head_dim
        cos, sin = (t.unsqueeze(2) for t in rotary)
        qk = heads[:, :, : nq + nk]
        qk = (qk * cos) + (self.rotate_half(qk) * sin)  # Hugging Face's apply_rotary_pos_emb, both at once
        return qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2), heads[:, :, nq + nk :].transpose(1, 2)


def _projections(parent: Any, names: tuple[str, ...], fused_name: str, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The projections of one input: one call of the fused group where there is one (the same bits as its parts)."""
    group = getattr(parent, fused_name, None)
    if group is not None:
        return group.fused(h).split(group.sizes, dim=-1)
    return tuple(getattr(parent, name)(h) for name in names)


def _visible(mask: torch.Tensor, width: int, past: int) -> torch.Tensor:
    """Which key columns each query sees, [B, 1, n, L]: a 4-D bool mask as given (a tree's); a 2-D mask [B, L]
    of the row's columns, causal by cache column (query i is column past + i), as masking_utils builds it."""
    if mask.dim() == 4:
        return mask.bool()
    length = mask.shape[1]
    columns = torch.arange(length, device=mask.device)
    causal = columns.unsqueeze(0) <= torch.arange(past, past + width, device=mask.device).unsqueeze(1)  # [n, L]
    return (mask.bool().unsqueeze(1) & causal.unsqueeze(0)).unsqueeze(1)


def use_own_forward(model: Any, choice: str) -> str:
    """Attaches our forward as `model.spec_batch_forward` where `choice` (auto | own | hf) and the model allow;
    returns the forward kind in use: "own" or "hf". `own` on a model it does not apply to raises ValueError."""
    if choice not in FORWARD_CHOICES:
        raise ValueError(f"forward {choice!r}: expected one of {', '.join(FORWARD_CHOICES)}")
    reason = None if choice == "hf" else why_not(model)
    if choice == "hf" or reason is not None:
        if choice == "own":
            raise ValueError(f"SPEC_BATCH_FORWARD=own does not apply to this model: {reason}")
        model.spec_batch_forward = None
        return "hf"
    model.spec_batch_forward = LlamaForward(model)
    return "own"


def forward_kind(model: Any) -> str:
    """The forward a loaded model decodes with: own | hf."""
    return "own" if getattr(model, "spec_batch_forward", None) is not None else "hf"
