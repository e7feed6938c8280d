"""Weight-only quantized linear layers: int4 (group-wise, as GGUF Q4_0/Q4_1 ship) and int8 (per output channel).

Both run torch's own kernels: int4 through `_weight_int4pack_mm_for_cpu` on the CPU and `_weight_int4pack_mm`
(tinygemm, what gpt-fast uses) on CUDA; int8 through `_weight_int8pack_mm`. The kernels run with `act_dtype`
activations (bf16: the int4 CPU kernel falls back to a reference path 10-25x slower with fp32 ones, docs/weights.md);
a layer takes and returns the model's own dtype, so a float32 model keeps its residual stream, norms and attention
in float32 and only the matrix products round their inputs to bf16.

int4 stores, per group of `group_size` input columns of one output row, a scale and a zero such that
weight = (q - 8) * scale + zero, q in 0..15. GGUF Q4_1 (weight = d * q + m) maps onto it exactly with
scale = d, zero = m + 8 d; Q4_0 (weight = d * (q - 8)) with scale = d, zero = 0. Nothing is re-quantized; the
scales are rounded only when the kernel wants them in bf16 (bf16 activations).

Like cpu_linear.PackedLinear, a layer computes only the real positions of a padded verify step
(core/kv/padding.py) and never calls its kernel with fewer than `min_rows` rows, so that a token's logits do not
depend on the batch it is computed in (tests/loading/test_quant_linear.py checks it bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.kv import padding

__all__ = [
    "INT4_GROUP_SIZE",
    "MIN_ROWS",
    "Int4Linear",
    "Int8Linear",
    "QuantEmbedding",
    "q4_1_groups",
    "require_concatenable",
]

INT4_GROUP_SIZE = 32
# Fewer rows than this are computed with zero rows added (as cpu_linear.MIN_ROWS does for oneDNN). Both kernels here
# compute a row the same bit for bit at every width (1..80 rows measured, tests pin it), so 1 suffices; a kernel
# code path for 1-3 rows, whose rounding differs from the wider one's.
MIN_ROWS = 1
# tinygemm's tiling: K must be a multiple of 16 * inner k tiles; gpt-fast uses 8, the default model's 576 needs 2
_CUDA_INNER_K_TILES = 8
# the packed layouts hold the outputs in blocks of this many rows (measured: CPU; tinygemm's layout: CUDA)
_CPU_OUT_BLOCK, _CUDA_OUT_BLOCK = 64, 8


def q4_1_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1's scheme on a float weight [out, in]: per group of `group_size` inputs, min/max onto 0..15.
    Returns q [out, in] uint8, scale d and minimum m [out, in / group_size] (weight ~ d * q + m)."""
    w = weight.detach().float().reshape(weight.shape[0], -1, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-10)
    q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(weight.shape)
    return q, scale, low


def require_concatenable(layers: list[nn.Module], keys: tuple[str, ...], what: str) -> None:
    """ValueError unless the layers agree on `keys` and all have a bias or none has: what any concatenation of
    layers side by side needs (fused_projections.py)."""
    first = layers[0]
    mixed_bias = len({l.bias is None for l in layers}) != 1
    if mixed_bias or any(getattr(l, k) != getattr(first, k) for l in layers for k in keys):
        raise ValueError(f"{what} layers of different shapes or settings do not concatenate")


class _RowsLinear(nn.Module):
    """The forward shared by the quantized layers: real positions only, at least `min_rows` rows per call."""

    skips_padding = True
    in_features: int
    out_features: int
    min_rows: int
    bias: torch.Tensor | None

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only (meta) stand-in: code that asks a layer for weight.shape (the decoder's vocabulary size)
        works; code that reads the values fails loudly instead of silently using a dequantized copy."""
        return torch.empty(self.out_features, self.in_features, device="meta", dtype=self.act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        real = padding.current()
        flat = x.reshape(-1, x.shape[-1])
        if real is None or tuple(x.shape[:-1]) != real.shape:
            return self._rows(flat).view(*x.shape[:-1], self.out_features)
        return real.scatter(self._rows(real.gather(x)))

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] in the model's dtype -> [n, out] in the same dtype (the kernel runs in act_dtype)."""
        n = rows.shape[0]
        if n < self.min_rows:
            rows = torch.cat([rows, rows.new_zeros(self.min_rows - n, rows.shape[1])])
        out = self._kernel(rows.contiguous())[:n]
        if self.bias is not None:
            out = out + self.bias
        return out.to(rows.dtype)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class Int4Linear(_RowsLinear):
    """A linear layer whose weight is int4, group-wise (weight = (q - 8) * scale + zero per group)."""

    def __init__(
        self,
        q: torch.Tensor,  # [out, in] uint8 values 0..15
        scale: torch.Tensor,  # [out, in / group_size]
        zero: torch.Tensor,  # [out, in / group_size]
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
        *,
        group_size: int = INT4_GROUP_SIZE,
        device: torch.device | str = "cpu",
        min_rows: int = MIN_ROWS,
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % group_size:
            raise ValueError(f"int4: {self.in_features} input features are not a multiple of group {group_size}")
        self.group_size, self.act_dtype, self.min_rows = group_size, act_dtype, min_rows
        device = torch.device(device)
        self.cuda_kernel = device.type == "cuda"
        q32 = q.to(torch.int32)
        if self.cuda_kernel:
            nibbles = (q32[:, ::2] << 4 | q32[:, 1::2]).to(torch.uint8).to(device)
            tiles = next((t for t in (_CUDA_INNER_K_TILES, 4, 2) if self.in_features % (16 * t) == 0), None)
            if tiles is None:
                raise ValueError(f"int4 on CUDA: {self.in_features} input features are not a multiple of 32")
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles))
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1))
        # [in / group_size, out, 2]: the kernel's layout of (scale, zero)
        self.register_buffer(
            "scales_and_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(device, act_dtype).contiguous()
        )
        self.bias = None if bias is None else bias.detach().to(device, act_dtype)

    @classmethod
    def from_q4_1(cls, q, d, m, bias, act_dtype, **kw) -> Int4Linear:
        """GGUF Q4_1 (weight = d * q + m): scale = d, zero = m + 8 d, exactly in fp32."""
        d, m = d.float(), m.float()
        return cls(q, d, m + 8 * d, bias, act_dtype, **kw)

    @classmethod
    def from_q4_0(cls, q, d, bias, act_dtype, **kw) -> Int4Linear:
        """GGUF Q4_0 (weight = d * (q - 8)): scale = d, zero = 0."""
        return cls(q, d.float(), torch.zeros_like(d, dtype=torch.float32), bias, act_dtype, **kw)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, act_dtype, *, group_size: int = INT4_GROUP_SIZE, **kw):
        """Weight-only int4 of a float weight [out, in]: per group, min/max onto 0..15 (Q4_1's scheme)."""
        q, scale, low = q4_1_groups(weight, group_size)
        return cls.from_q4_1(q, scale, low, bias, act_dtype, group_size=group_size, **kw)

    @classmethod
    def concat(cls, layers: list[Int4Linear]) -> Int4Linear:
        """One layer computing `layers` side by side (their outputs concatenated): the packed weights hold the
        outputs in blocks (64 on the CPU, tinygemm's 8 on CUDA), so they concatenate as they are where every layer
        but the last fills its blocks."""
        first = layers[0]
        same = ("in_features", "group_size", "act_dtype", "min_rows", "cuda_kernel")
        require_concatenable(layers, same, "int4")
        block = _CUDA_OUT_BLOCK if first.cuda_kernel else _CPU_OUT_BLOCK
        if any(l.out_features % block for l in layers[:-1]):
            raise ValueError(f"int4 layers concatenate only at multiples of {block} outputs")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        for key in same:
            setattr(fused, key, getattr(first, key))
        fused.out_features = sum(l.out_features for l in layers)
        fused.register_buffer("packed", torch.cat([l.packed for l in layers]))
        fused.register_buffer("scales_and_zeros", torch.cat([l.scales_and_zeros for l in layers], dim=1))
        fused.bias = None if first.bias is None else torch.cat([l.bias for l in layers])
        return fused

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.to(self.act_dtype)
        if self.cuda_kernel:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32, as the kernel sees it (scales in their stored dtype)."""
        eye = torch.eye(self.in_features, dtype=self.act_dtype, device=self.packed.device)
        return self._kernel(eye).float().t().contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}, "
            f"activations {self.act_dtype}"
        )


class Int8Linear(_RowsLinear):
    """A linear layer whose weight is int8 with one scale per output channel (weight = q * scale)."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias,
        act_dtype: torch.dtype,
        *,
        device: torch.device | str = "cpu",
        min_rows: int = MIN_ROWS,
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.act_dtype, self.min_rows = act_dtype, min_rows
        self.register_buffer("weight_int8", q.to(device, torch.int8).contiguous())
        self.register_buffer("scales", scale.to(device, act_dtype).contiguous())
        self.bias = None if bias is None else bias.detach().to(device, act_dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, act_dtype, **kw) -> Int8Linear:
        """Symmetric per-channel int8 of a float weight [out, in]."""
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-10)
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale, bias, act_dtype, **kw)

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, d: torch.Tensor, bias, act_dtype, **kw) -> Int8Linear:
        """GGUF Q8_0 (weight = d * q per group of 32) onto per-channel scales: the kernel takes one scale per
        row, so each row is re-expressed with its largest group scale; groups with that scale stay exact, the
        others are rounded once (a half step of the row's scale at most; docs/weights.md measures it)."""
        d = d.float()  # [out, groups]
        row_scale = d.amax(1).clamp_min(1e-10)
        group = q.shape[1] // d.shape[1]
        w = q.float().reshape(q.shape[0], -1, group) * (d / row_scale[:, None])[..., None]
        q8 = w.round().clamp(-127, 127).to(torch.int8).reshape(q.shape)
        return cls(q8, row_scale, bias, act_dtype, **kw)

    @classmethod
    def concat(cls, layers: list[Int8Linear]) -> Int8Linear:
        """One layer computing `layers` side by side (their outputs concatenated)."""
        first = layers[0]
        require_concatenable(layers, ("in_features", "act_dtype", "min_rows"), "int8")
        bias = None if first.bias is None else torch.cat([l.bias for l in layers])
        return cls(
            torch.cat([l.weight_int8 for l in layers]),
            torch.cat([l.scales for l in layers]),
            bias,
            first.act_dtype,
            device=first.weight_int8.device,
            min_rows=first.min_rows,
        )

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows.to(self.act_dtype), self.weight_int8, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (any shape) in fp32: a tied input embedding's lookup."""
        return self.weight_int8[ids].to(torch.float32) * self.scales.float()[ids].unsqueeze(-1)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, "
            f"activations {self.act_dtype}"
        )


class QuantEmbedding(nn.Module):
    """Input embeddings read from a quantized LM head's rows (a tied one: Int8Linear, block_linear.Q8BlockLinear,
    anything with `embedding_rows`): the rows looked up are dequantized, so the table is kept once, in int8."""

    def __init__(self, table: Int8Linear, out_dtype: torch.dtype, padding_idx: int | None = None):
        super().__init__()
        self.table, self.out_dtype, self.padding_idx = table, out_dtype, padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only (meta) stand-in, as for the linear layers."""
        return torch.empty(self.num_embeddings, self.embedding_dim, device="meta", dtype=self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.embedding_rows(ids).to(self.out_dtype)
