"""An EAGLE-style draft head: one decoder layer over [embedding(token) ; target hidden state], predicting the
target's next hidden state ("feature"), with a reduced-vocabulary LM head (FR-Spec) over it.

EAGLE (arXiv 2401.15077): at position t the head reads the target's last hidden state f_t and the embedding of
token t+1, fuses them with one linear layer (`fc`), runs one decoder layer and outputs f^_{t+1}; the LM head on
f^_{t+1} gives the distribution of token t+2. Drafting feeds its own f^ back with the token it drafted.
The layer is Llama-shaped (RMSNorm, RoPE, grouped-query attention, SwiGLU) with Llama's key names, so its
weights read like published EAGLE heads'. The embedding is the target's own (shared, never stored: on a 135M
model it is a fifth of the model); the LM head covers `draft_vocab_size` tokens, mapped to the target's ids by
`d2t` (draft id -> target id).

The module is called like a Hugging Face causal LM by core/kv/kv_batch.KVBatch (input_ids, attention_mask,
position_ids, past_key_values, logits_to_keep), plus `features`, so it keeps its KV cache in the same
per-row-masked cache as the models, with the same rollback, row selection and compaction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HEAD_FORMAT = "spec-batch-head"


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's (output rows)
    draft_vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    target: str = ""  # the target it was trained for (as the decoder names it)
    input_norm: bool = True  # EAGLE-1's published heads skip the first layer's input norm
    final_norm: bool = False  # EAGLE-3 normalizes the feature before its LM head
    # the head reads the target's own LM head (never stored): EAGLE-1's published heads over the full vocabulary,
    # heads spec-batch trains over the rows of the draft vocabulary (d2t)
    shared_lm_head: bool = False
    layout: str = "eagle"  # "eagle": fc(embedding ; state) -> layer; "eagle3": EAGLE-3 layout, core/heads/head.py
    # the target's hidden states the head reads, as Hugging Face's hidden_states indices (the input of that layer);
    # empty: the last hidden state (after the final norm). EAGLE-3 reads a low, a middle and a high one.
    target_layers: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # training facts (tokens, held-out accepted length, ...)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def to_json(self) -> dict[str, Any]:
        return {"format": HEAD_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeadConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def for_target(cls, target_config: Any, draft_vocab_size: int, target: str) -> HeadConfig:
        """A head shaped like one layer of the target (its attention geometry, RoPE base and norm epsilon)."""
        c = target_config
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rope_theta=_rope_theta(c),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-5),
            target=target,
        )


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


@dataclass
class HeadOutput:
    logits: torch.Tensor  # [B, n or keep, draft_vocab]
    features: torch.Tensor  # [B, n, H] the predicted next hidden states


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: HeadConfig, in_features: int = 0):
        super().__init__()
        self.c = c
        width = in_features or c.hidden_size  # EAGLE-3's attention reads [embedding ; state]: 2 x hidden
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, cache: Any | None
    ) -> torch.Tensor:
        b, n, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, n, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, h, n, d]
        k = self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, 0)  # [B, h_kv, past + n, d]
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))  # mask [B, n, past + n]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_norm = c.input_norm

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor, cache: Any | None) -> torch.Tensor:
        h = self.input_layernorm(x) if self.input_norm else x
        x = x + self.self_attn(h, rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's layer (arXiv 2503.01840; vLLM's and SGLang's `LlamaForCausalLMEagle3`): attention reads
    [norm(embedding) ; norm(state)] (2 x hidden), the residual stream is the state itself."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = Attention(c, 2 * c.hidden_size)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, emb: torch.Tensor, state: torch.Tensor, rope, mask: torch.Tensor, cache: Any | None
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(state)], dim=-1)
        residual = state + self.self_attn(x, rope, mask, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig, embed_tokens: nn.Module | None = None):
        super().__init__()
        self.config = config
        c = config
        if c.layout == "eagle3":  # fc fuses the target's low, middle and high states (no bias in the layout)
            self.fc = nn.Linear(max(1, len(c.target_layers) or 3) * c.hidden_size, c.hidden_size, bias=False)
            self.layers = nn.ModuleList([Eagle3Layer(c)])
        else:
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
            self.layers = nn.ModuleList([DecoderLayer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.final_norm else None
        # a shared LM head is the target's module, attached with the embedding (never stored)
        self.lm_head = None if c.shared_lm_head else nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(c.draft_vocab_size, dtype=torch.long))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        # the target's embedding, shared and frozen: kept out of the module tree so it is neither saved nor trained
        self.__dict__["embed_tokens"] = embed_tokens

    def attach(self, embed_tokens: nn.Module, lm_head: nn.Module | None = None) -> EagleHead:
        """The target's embedding (and LM head, for a head that shares it)."""
        self.__dict__["embed_tokens"] = embed_tokens
        self.__dict__["target_lm_head"] = lm_head
        self.__dict__.pop("reduced_lm_head", None)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (a norm's weight: its linear layers may be int8 for drafting)."""
        return self.layers[0].post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].post_attention_layernorm.weight.device

    @property
    def feature_width(self) -> int:
        """Width of the target states the head reads (EAGLE-3: several layers side by side)."""
        return self.fc.in_features if self.config.layout == "eagle3" else self.config.hidden_size

    def _lm_head(self) -> nn.Module:
        if self.lm_head is not None:
            return self.lm_head
        lm = self.__dict__.get("target_lm_head")
        if lm is None:
            raise ValueError("this head drafts with the target's LM head: attach(embedding, lm_head) first")
        if self.config.draft_vocab_size >= self.config.vocab_size:
            return lm
        return self._reduced(lm)

    def _reduced(self, lm: nn.Module) -> nn.Module:
        """The target's LM head rows of the draft vocabulary (frozen; rebuilt when the head moves or changes dtype)."""
        cached = self.__dict__.get("reduced_lm_head")
        if (
            cached is None
            or cached[0] is not lm
            or cached[1].weight.device != self.device
            or cached[1].weight.dtype != self.dtype
        ):
            with torch.inference_mode(False), torch.no_grad():  # built while drafting, later read by training too
                reduced = nn.Linear(
                    self.config.hidden_size,
                    self.config.draft_vocab_size,
                    bias=False,
                    device=self.device,
                    dtype=self.dtype,
                )
                reduced.weight.copy_(target_rows(lm, self.d2t))
                reduced.weight.requires_grad_(False)
            self.__dict__["reduced_lm_head"] = cached = (lm, reduced)
        return cached[1]

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        logits_to_keep: int = 0,
        raw: bool = True,
        **_: Any,
    ) -> HeadOutput:
        """input_ids [B, n] (token t+1), features [B, n, W] (state at t: the target's, W = feature_width, when
        raw; else the head's own predicted [B, n, H]); attention_mask [B, past + n] (1 = the row's token) or 4-D,
        position_ids [B, n]. Without a cache: one causal pass over the n positions."""
        b, n = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(b, n, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(n, device=device).expand(b, n)
        with torch.no_grad():  # the target's frozen embedding: no gradient (it would be vocab x H per step)
            emb = self.embed_tokens(input_ids).to(self.dtype)
        rope = _rope(position_ids, self.inv_freq, emb.dtype)
        mask = _mask(attention_mask, n)
        if self.config.layout == "eagle3":  # the target's states are fused by fc; its own predictions are not
            state = self.fc(features.to(emb.dtype)) if raw else features.to(emb.dtype)
            x = self.layers[0](emb, state, rope, mask, past_key_values)
        else:
            x = self.layers[0](self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1)), rope, mask, past_key_values)
        kept = x[:, -logits_to_keep:] if logits_to_keep else x
        logits = self._lm_head()(self.norm(kept) if self.norm is not None else kept)
        return HeadOutput(logits=logits, features=x)


def _mask(attention_mask: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n, total] bool: query i (column past + i) sees the row's columns up to itself; every query sees
    itself, so a padded query (whose output nobody reads) never has an empty row (NaN). A 4-D attention_mask
    [B, 1, n, total] (a tree's: KVBatch.forward_tree) is used as it is."""
    if attention_mask.dim() == 4:
        return attention_mask[:, 0].bool()
    total = attention_mask.shape[1]
    past = total - n
    cols = torch.arange(total, device=attention_mask.device)
    query_cols = past + torch.arange(n, device=attention_mask.device)
    causal = cols.unsqueeze(0) <= query_cols.unsqueeze(1)  # [n, total]
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    return allowed | (cols.unsqueeze(0) == query_cols.unsqueeze(1)).unsqueeze(0)


def _rope(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, n, d/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [B, 1, n, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


STORAGE_DTYPE = torch.bfloat16  # weights are stored in bfloat16 (half of float32's bytes) and computed in float32


def stored_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's tensors as they are stored: floating ones in STORAGE_DTYPE, on the CPU."""
    return {
        k: (v.to(STORAGE_DTYPE) if v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in head.state_dict().items()
    }


def round_to_storage(head: EagleHead) -> EagleHead:
    """Rounds the head's weights in place to what storing keeps (so what is measured is what is stored)."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(STORAGE_DTYPE))
    return head


def target_rows(lm: nn.Module, d2t: torch.Tensor) -> torch.Tensor:
    """The target LM head's rows of the draft vocabulary (an int4/int8 target's: their dequantized values)."""
    weight = lm.dequantized() if hasattr(lm, "dequantized") else lm.weight
    return weight[d2t.to(weight.device)]


def param_count(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())


LAYOUTS = ("eagle", "eagle3")


def eagle3_layers(num_hidden_layers: int) -> list[int]:
    """The target states an EAGLE-3 head reads when its config names none: a low, a middle and a high layer's
    input, in vLLM's and SGLang's order (a published head's fc reads them so); within 0..num_hidden_layers for a
    small target."""
    n = num_hidden_layers
    return [min(max(i, 0), n) for i in (2, n // 2, n - 3)]


def head_for_target(
    target: Any, d2t: torch.Tensor, target_name: str, shared_lm_head: bool = True, layout: str = "eagle"
) -> EagleHead:
    """A new head shaped for target (one of its layers), over the draft vocabulary d2t, started as training
    starts it (`init_from_target`), sharing the target's embedding and (shared_lm_head) the target's LM head rows
    of the draft vocabulary, frozen and never stored (EAGLE's choice: the head regresses onto the target's hidden
    states, which the target's LM head reads); else its own LM head over them, trained and stored.
    layout "eagle3": EAGLE-3's head (arXiv 2503.01840), reading the target's low, middle and high states fused by
    fc, with its own norm before the LM head."""
    if layout not in LAYOUTS:
        raise ValueError(f"head layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    config = HeadConfig.for_target(target.config, len(d2t), target_name)
    config.shared_lm_head = shared_lm_head
    if layout == "eagle3":
        config.layout, config.final_norm = "eagle3", True
        config.target_layers = eagle3_layers(target.config.num_hidden_layers)
    head = EagleHead(config, target.get_input_embeddings())
    head.to(device=target.get_input_embeddings().weight.device)
    init_from_target(head, target, d2t.to(head.device))
    return head.eval()


def init_from_target(head: EagleHead, target: Any, d2t: torch.Tensor) -> None:
    """Starts the LM head as the target's rows for the draft vocabulary (shared, or copied to be trained), and fc's
    feature half near the identity (a residual start: an untrained head already passes the target's state through;
    EAGLE-3: its highest layer's state)."""
    with torch.no_grad():
        head.d2t.copy_(d2t)
        lm = target.get_output_embeddings()
        if head.lm_head is None:
            head.attach(target.get_input_embeddings(), lm)
        else:
            head.lm_head.weight.copy_(target_rows(lm, d2t))
        h = head.config.hidden_size
        head.fc.weight[:, -h:] += torch.eye(h, dtype=head.fc.weight.dtype)
        if head.fc.bias is not None:
            head.fc.bias.zero_()
