"""Our own forward for the Llama family (Llama, SmolLM2, Mistral and Qwen2 without sliding windows).

Hugging Face's forward spends much of a small model's decode step outside arithmetic: per layer, a decorated
module call chain, keyword plumbing, the attention-interface lookup, the cache's per-layer dispatch and the fused
projections' per-part bookkeeping; per forward, a 4-D mask built by masking_utils. This forward runs the same
layers over the same loaded modules (no second copy of any weight) in one flat loop:

- the fused q/k/v and gate/up groups are called once each (loading/fused_projections.py),
- the visibility of each query is built once per forward, as a bool [B, 1, n, L], and the native attention kernel
  reads it directly (loading/kernels/cpu_attention.cpp),
- between the matmuls, one native call each (loading/kernels/layer_glue.cpp) replaces a Python sequence of 5-8
  operators: residual add + RMSNorm, the rotary embedding of q's and k's heads, SiLU(gate) * up. Each computes
  Hugging Face's operators in its order: torch's own kernels for the reductions and the activation, single IEEE
  operations rounded where torch rounds for the rest. Other norms and activations run the model's own modules.
- where every projection of a layer is a whole-tile W4A8 layer and the activations are float32 (w4a8's default),
  the steps before and after the attention are one native call each (`layer_before_attention`, `_after_`): the
  same kernels in the same order without a Python round trip between them (on a 135M model, each op call's fixed
  cost adds up to a large part of a decode step); a padded step's gather and scatter of its real positions happen
  inside them, as RealPositions does them. On a decode step (every layer's cache a slab holding float32), the
  whole stack is one native call (`decoder_layers`: those two calls and the attention's, layer after layer).

**The same bits as Hugging Face's forward.** Every operator is the one Hugging Face runs, on the same inputs in the
same order, and the native kernel's result depends only on which columns a query sees, never on how the mask was
written: the logits of every real position are identical bit for bit (tests/loading/test_llama_forward.py checks it
at every width, batch, tree mask and precision; a padded position's, which nothing reads, may differ: `_visible`).
So the forward kind never changes an output and needs no place in a job's routing.

It applies where `applies_to` says: a Llama-family model on the CPU whose attention is the native kernel. Hidden-
state hooks on the final norm fire as before (core/heads/hidden.py); a model with hooks on its layers or embeddings
(EAGLE-3 features) and calls with extra model arguments use Hugging Face's forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..core.kv import padding
from ..core.kv.kv_batch import SlabLayer
from .block_linear import BlockLinear
from .cpu_attention import attention_kind

FORWARD_CHOICES = ("auto", "own", "hf")
FAMILY = ("llama", "mistral", "qwen2")
_NO_BIAS = torch.empty(0)
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # the same forward, kernels/layer_glue.cpp's
_SILU = ("SiLUActivation", "SiLU")


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


class _W4A8(NamedTuple):
    """A W4A8 layer's kernel inputs, read once: the forward is attached after the weights are final (load.py)."""

    packed: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    out_features: int


class _Native(NamedTuple):
    """A layer's own inputs to the native layer steps (layer_glue.cpp), after each call's: bound once."""

    before: tuple  # input norm weight and epsilon, the q/k/v kernel inputs, query heads, key heads, head dim
    after: tuple  # post-attention norm weight and epsilon, o, gate/up, the gate's width, down


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's modules, looked up once; `plain` holds its W4A8 layers that the kernel alone computes."""

    attn: Any
    mlp: Any
    input_norm: Any
    post_norm: Any
    qkv: Any  # the fused q/k/v group, or None
    gate_up: Any  # the fused gate/up group, or None
    plain: dict[str, _W4A8]  # "qkv", "o", "gate_up", "down" -> its kernel inputs, where BlockLinear.kernel_is_forward
    native: _Native | None  # where the native layer steps run it: the family's glue, fused groups, every part plain

    @classmethod
    def of(cls, layer: Any, glue: bool) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
        modules = {
            "qkv": qkv.fused if qkv is not None else None,
            "o": attn.o_proj,
            "gate_up": gate_up.fused if gate_up is not None else None,
            "down": mlp.down_proj,
        }
        plain = {
            name: _W4A8(m.packed, m.scales, m.minimums, m.out_features)
            for name, m in modules.items()
            if isinstance(m, BlockLinear) and m.kernel_is_forward()
        }
        input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        native = None
        if glue and qkv is not None and gate_up is not None and len(plain) == 4:
            heads = [size // attn.head_dim for size in qkv.sizes[:2]]
            native = _Native(
                (input_norm.weight, input_norm.variance_epsilon, *plain["qkv"][:3], *heads, attn.head_dim),
                (post_norm.weight, post_norm.variance_epsilon, *plain["o"][:3], *plain["gate_up"][:3])
                + (gate_up.sizes[0], *plain["down"][:3]),
            )
        return cls(attn, mlp, input_norm, post_norm, qkv, gate_up, plain, native)


class _Stack(NamedTuple):
    """Every layer's native inputs, flat, for one native call over the whole stack (`decoder_layers`), where every
    layer runs the native steps with the same head counts and gate width."""

    weights: list[torch.Tensor]  # 14 a layer: _Native's tensors in its order
    eps: list[float]  # 2 a layer
    sizes: tuple[int, int, int, int]  # query heads, key heads, head dim, gate width

    @classmethod
    def of(cls, parts: list[_Layer]) -> _Stack | None:
        natives = [part.native for part in parts]
        if not natives or any(n is None for n in natives):
            return None
        sizes = {(*n.before[-3:], n.after[8]) for n in natives}
        if len(sizes) != 1:
            return None
        weights = [t for n in natives for t in (n.before[0], *n.before[2:5], n.after[0], *n.after[2:8], *n.after[9:])]
        return cls(weights, [e for n in natives for e in (n.before[1], n.after[1])], sizes.pop())


class LlamaForward:
    """A callable with the keyword signature KVBatch uses for a model call, over `model`'s own modules."""

    def __init__(self, model: Any) -> None:
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, list(inner.layers), inner.norm
        self.glue = _glue_applies(self.layers)
        self.final_glue = self.glue and type(self.norm).__name__ in _RMS_NORMS  # the last norm the glue's too
        self.parts = [_Layer.of(layer, self.glue) for layer in self.layers]
        self.stack = _Stack.of(self.parts)
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
        real = padding.current()
        if real is not None and real.shape != tuple(input_ids.shape):
            real = None  # not this call's hint
        # the kernel alone where the module's forward would add nothing: fp32 activations (the layers see packed
        # real positions only, or no padding at all)
        direct = x.dtype == torch.float32
        if real is not None:  # a padded step: the layers run on the real positions alone, packed as [1, N, H]
            x = real.gather(x).unsqueeze(0)
        slabs = _slabs(past_key_values, len(self.parts), x.dtype) if direct and self.stack is not None else None
        if slabs is not None:  # a decode step: every layer in one native call (the same calls, the same bits)
            x, delta = self._stack(x, (cos, sin), visible, slabs, input_ids.shape[1], real)
        else:
            delta = None  # each layer's last residual term, added where the next norm reads the sum
            for i, part in enumerate(self.parts):
                x, delta = self._layer(i, part, x, delta, (cos, sin), visible, past_key_values, direct, real)
        x = x + delta
        if real is not None:  # back to [B, n, H] (zeros at the padded positions) for the norm's hooks and the head
            x = real.scatter(x[0])
        x = self._final_norm(x)
        kept = x[:, -logits_to_keep:] if logits_to_keep else x
        return ForwardOutput(logits=self.lm_head(kept), past_key_values=past_key_values)

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's last norm: through its __call__ where a hook reads it (core/heads/hidden.py's), else the
        family's RMSNorm as one native call, as the layers' norms (the same bits; ~0.1 ms of a batch-1 step)."""
        norm = self.norm
        if not self.final_glue or norm._forward_hooks or norm._forward_pre_hooks:
            return norm(x)
        return torch.ops.spec_batch.rms_norm(x, norm.weight, norm.variance_epsilon)

    def _stack(
        self, x: torch.Tensor, rotary: tuple, visible: torch.Tensor, slabs: list[SlabLayer], n: int, real: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' loop in one native call: the slabs make room for the step's n columns first, and count
        them as written after (as `_attend_appended` does a layer at a time)."""
        keys, values, lengths = zip(*(layer.room(n) for layer in slabs))
        positions = None if real is None else real.index
        stack = self.stack
        out = torch.ops.spec_batch.decoder_layers(
            x, *rotary, positions, visible, self.scale, keys, values, lengths, stack.weights, stack.eps, *stack.sizes
        )
        for layer in slabs:
            layer.advance(n)
        return out

    def _layer(
        self,
        index: int,
        part: _Layer,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotary: tuple,
        visible: torch.Tensor,
        cache: Any,
        direct: bool,
        real: padding.RealPositions | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: (its residual stream before the MLP's term, the MLP's term). real: x holds only these
        positions, packed; attention runs on the step's [B, n] layout, its padded queries seeing nothing."""
        # float32 rows of a layer the native steps run: the same kernels in the same order as below, and a padded
        # step's gather and scatter as RealPositions does them, in two native calls (the same bits)
        native = part.native if direct else None
        positions = None if real is None else real.index
        if native is not None:
            x, q, k, v = torch.ops.spec_batch.layer_before_attention(x, delta, *rotary, positions, *native.before)
        else:
            x, h = self._add_norm(part.input_norm, x, delta)
            q, k, v = self._queries_keys_values(part, h, rotary, direct, real)
        out = _attend_appended(cache, index, q, k, v, visible, self.scale)  # [B, n, H, D]
        if native is not None:
            return torch.ops.spec_batch.layer_after_attention(x, out, positions, *native.after)
        out = out.reshape(*out.shape[:2], -1)
        attended = _linear(part, "o", part.attn.o_proj, out if real is None else real.gather(out).unsqueeze(0), direct)
        x, h = self._add_norm(part.post_norm, x, attended)
        return x, self._mlp(part, h, direct)

    def _add_norm(self, norm: Any, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(x + delta, norm(x + delta)); one native call for the family's RMSNorm (the same bits)."""
        if not self.glue:
            x = x if delta is None else x + delta
            return x, norm.forward(x)
        if delta is None:
            return x, torch.ops.spec_batch.rms_norm(x, norm.weight, norm.variance_epsilon)
        return torch.ops.spec_batch.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)

    def _mlp(self, part: _Layer, h: torch.Tensor, direct: bool) -> torch.Tensor:
        mlp, group = part.mlp, part.gate_up
        if group is None:
            gated = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
        else:
            both = _linear(part, "gate_up", group.fused, h, direct)
            if self.glue:
                gated = torch.ops.spec_batch.silu_mul(both, group.sizes[0])
            else:
                gate, up = both.split(group.sizes, dim=-1)
                gated = mlp.act_fn(gate) * up
        return _linear(part, "down", mlp.down_proj, gated, direct)

    def _queries_keys_values(
        self, part: _Layer, h: torch.Tensor, rotary: tuple, direct: bool, real: padding.RealPositions | None
    ) -> tuple:
        """q, k, v [B, heads, n, D] with the rotary embedding applied to q and k. With a fused q/k/v group, q's and
        k's heads rotate in one pass over the group's output: elementwise, so the same bits as one pass each.
        real: h holds these positions, packed; q, k and v come back in the step's layout, zeros where padded (what
        the layers that skip padding return there)."""
        rows, width = rotary[0].shape[:2]
        attn, group = part.attn, part.qkv

        def spread(t: torch.Tensor) -> torch.Tensor:  # [B, n, heads, D]
            return (t if real is None else real.scatter(t[0])).view(rows, width, -1, self.head_dim)

        if group is None:
            q, k, v = (spread(getattr(attn, name)(h)).transpose(1, 2) for name in ("q_proj", "k_proj", "v_proj"))
            return (*self.apply_rotary(q, k, *rotary), v)
        heads = spread(_linear(part, "qkv", group.fused, h, direct))  # [B, n, H, D]
        nq, nk = group.sizes[0] // self.head_dim, group.sizes[1] // self.head_dim
        if self.glue:
            return torch.ops.spec_batch.rotary_heads(heads, *rotary, nq, nk)
        cos, sin = (t.unsqueeze(2) for t in rotary)
        qk = heads[:, :, : nq + nk]
        qk = (qk * cos) + (self.rotate_half(qk) * sin)  # Hugging Face's apply_rotary_pos_emb, both at once
        return qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2), heads[:, :, nq + nk :].transpose(1, 2)


def _linear(part: _Layer, name: str, module: Any, x: torch.Tensor, direct: bool) -> torch.Tensor:
    """module(x); a plain W4A8 layer on a direct call runs the kernel with no Python between (the same bits as its
    forward, which calls the same kernel and then changes nothing)."""
    plain = part.plain.get(name) if direct else None
    if plain is None:
        return module(x)
    flat = torch.ops.spec_batch.w4a8_linear(x.reshape(-1, x.shape[-1]), plain.packed, plain.scales, plain.minimums)
    return flat.view(*x.shape[:-1], plain.out_features)


def _attend_appended(
    cache: Any, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """k and v appended to the layer's cache, then q's attention over it: one native call where the layer is a slab
    already holding this dtype (every decode step), else the cache's update and then the attention."""
    layer = cache.layers[index] if index < len(cache.layers) else None
    if isinstance(layer, SlabLayer) and layer.is_initialized and layer.dtype == k.dtype:
        n = k.shape[2]
        key_slab, value_slab, length = layer.room(n)
        out = torch.ops.spec_batch.attend_appended(q, k, v, key_slab, value_slab, length, visible, _NO_BIAS, scale)
        layer.advance(n)
        return out
    keys, values = cache.update(k, v, index)
    return torch.ops.spec_batch.attend(q, keys, values, visible, _NO_BIAS, scale)


def _slabs(cache: Any, layers: int, dtype: torch.dtype) -> list[SlabLayer] | None:
    """The cache's layers where each is a slab already holding `dtype` (every decode step), else None."""
    slabs = getattr(cache, "layers", None)
    if slabs is None or len(slabs) != layers:
        return None
    ready = all(isinstance(layer, SlabLayer) and layer.is_initialized and layer.dtype == dtype for layer in slabs)
    return list(slabs) if ready else None


def _glue_applies(layers: list[Any]) -> bool:
    """Whether the layers are the family's own RMSNorm and SiLU modules: then kernels/layer_glue.cpp runs the
    operators between the matmuls (the same bits as Hugging Face's). Neither path calls a norm's hooks."""
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    return all(type(n).__name__ in _RMS_NORMS for n in norms) and all(
        type(layer.mlp.act_fn).__name__ in _SILU for layer in layers
    )


def _visible(mask: torch.Tensor, width: int, past: int) -> torch.Tensor:
    """Which key columns each query sees, [B, 1, n, L]: a 4-D bool mask as given (a tree's); a 2-D mask [B, L]
    of the row's columns, causal by cache column (query i is column past + i), as masking_utils builds it, except
    that a padded query (its own column masked) sees nothing: the kernel skips it (its output is zeros, which
    nothing reads), where attending to the row's context would cost a real query's time for each padded one."""
    if mask.dim() == 4:
        return mask.bool()
    length = mask.shape[1]
    columns = torch.arange(length, device=mask.device)
    causal = columns.unsqueeze(0) <= torch.arange(past, past + width, device=mask.device).unsqueeze(1)  # [n, L]
    seen = mask.bool()
    return (seen.unsqueeze(1) & causal.unsqueeze(0) & seen[:, length - width :].unsqueeze(2)).unsqueeze(1)


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
