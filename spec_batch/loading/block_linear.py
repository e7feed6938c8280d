"""W4A8 linear layers (weights: w4a8): 4-bit weight blocks as GGUF Q4_0/Q4_1 ship them, activations quantized to
int8 per block of 32, integer dot products in the native kernel (kernels/block_linear.cpp). The precision's LM head
(and any Q8_0 tensor) runs as W8A8: 8-bit weight blocks as GGUF Q8_0 ships them against the same int8 activations,
what llama.cpp computes for such a tensor.

Nothing of the file is re-quantized: a block's q, d and m are the file's (d and m in float16, as it ships them:
a block's 32 weights stream in the file's 20 or 34 bytes). A row's outputs are the same bits at
every row count, because the block sums are integers and the float steps per row are fixed (the kernel's header
says how), so speculation stays exact. The activations' int8 rounding makes outputs differ from int4's and full's
(docs/weights.md: agreement with full fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.kv import padding
from .quant_linear import _RowsLinear, q4_1_groups, require_concatenable

BLOCK, TILE = 32, 8


def _tiles(q: torch.Tensor, *scales: torch.Tensor, fill: int = 0) -> tuple[torch.Tensor, ...]:
    """q [out, K] (byte values) and per-block scales [out, K / 32], padded to whole tiles of outputs (q with `fill`)
    -> q as uint8 [tiles, blocks, 8 input groups, 8 outputs, 4 inputs] and each scale as float16 [tiles, blocks, 8]:
    the kernels' layout (their header)."""
    out, k = q.shape
    pad = -out % TILE
    tiles, blocks = (out + pad) // TILE, k // BLOCK
    grouped = F.pad(q, (0, 0, 0, pad), value=fill).to(torch.uint8).view(tiles, TILE, blocks, 8, 4)
    tiled = [F.pad(s.half(), (0, 0, 0, pad)).view(tiles, TILE, blocks).permute(0, 2, 1).contiguous() for s in scales]
    return (grouped.permute(0, 2, 3, 1, 4), *tiled)  # [t, b, p, o, j]


def _pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [out, K] in 0..15, d and m [out, K / 32] -> the W4A8 kernel's tiles: groups p and p + 4 share a byte."""
    grouped, scales, minimums = _tiles(q, d, m)
    packed = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)
    return packed.contiguous(), scales, minimums


def _pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, K] in -127..127, d [out, K / 32] -> the W8A8 kernel's tiles: q + 128 as [tiles, blocks, 8, 8, 4]."""
    grouped, scales = _tiles(q.to(torch.int16) + 128, d, fill=128)
    return grouped.contiguous(), scales


class _TiledLinear(_RowsLinear):
    """What the block layers share: the kernel computes whole tiles of outputs in float32 from rows of the model's
    dtype (no rows added: a row's outputs do not depend on the others)."""

    packed: torch.Tensor
    scales: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if padding.current() is not None:  # a padded verify step: real positions only (_RowsLinear)
            return super().forward(x)
        return self._rows(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        out = self._kernel(rows)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.to(rows.dtype)

    @classmethod
    def _concat_tiles(cls, layers: list, buffers: tuple[str, ...], what: str):
        """One layer computing `layers` side by side: tiles concatenate where every layer but the last fills
        its tiles."""
        require_concatenable(layers, ("in_features", "act_dtype"), what)
        if any(layer.out_features % TILE for layer in layers[:-1]):
            raise ValueError(f"{what} layers concatenate only at multiples of {TILE} outputs")
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.act_dtype, fused.min_rows = layers[0].in_features, layers[0].act_dtype, 1
        fused.out_features = sum(layer.out_features for layer in layers)
        for name in buffers:
            fused.register_buffer(name, torch.cat([getattr(layer, name) for layer in layers]))
        fused.bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
        return fused


class BlockLinear(_TiledLinear):
    """A linear layer of Q4 weight blocks (w = d q + m per block of 32 inputs) run by the W4A8 kernel."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, act_dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % BLOCK:
            raise ValueError(f"w4a8: {self.in_features} input features are not a multiple of {BLOCK}")
        self.act_dtype, self.min_rows = act_dtype, 1
        packed, scales, minimums = _pack(q, d, m)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("minimums", minimums)
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_q4_1(cls, q, d, m, bias, act_dtype) -> BlockLinear:
        return cls(q, d, m, bias, act_dtype)

    @classmethod
    def from_q4_0(cls, q, d, bias, act_dtype) -> BlockLinear:
        """GGUF Q4_0 (w = d (q - 8)): m = -8 d, exact in fp32."""
        return cls(q, d, -8 * d.float(), bias, act_dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, act_dtype) -> BlockLinear:
        """Q4_1's scheme on a float weight [out, in]: per block, min/max onto 0..15; d and m kept in float16, as
        the file format (and llama.cpp's quantizer) stores them."""
        q, scale, low = q4_1_groups(weight, BLOCK)
        return cls(q, scale, low, bias, act_dtype)

    @classmethod
    def concat(cls, layers: list[BlockLinear]) -> BlockLinear:
        """One layer computing `layers` side by side (_TiledLinear._concat_tiles)."""
        return cls._concat_tiles(layers, ("packed", "scales", "minimums"), "w4a8")

    def kernel_is_forward(self) -> bool:
        """Whether `_rows` on fp32 rows returns the kernel's output unchanged: no bias to add, whole tiles (no
        columns to cut). Then a caller with fp32 rows may call the kernel itself (loading/llama_forward.py)."""
        return self.bias is None and self.packed.shape[0] * TILE == self.out_features

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.spec_batch.w4a8_linear(rows, self.packed, self.scales, self.minimums)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32 (the activations' rounding aside, what the kernel multiplies by)."""
        low = self.packed & 0x0F
        high = self.packed >> 4
        q = torch.cat([low, high], dim=2).permute(0, 3, 1, 2, 4).float()  # [t, o, b, p, j]
        d, m = self.scales.float().permute(0, 2, 1), self.minimums.float().permute(0, 2, 1)
        w = q * d[..., None, None] + m[..., None, None]
        return w.reshape(-1, self.in_features)[: self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w4a8 blocks of {BLOCK}"


class Q8BlockLinear(_TiledLinear):
    """A linear layer of Q8_0 weight blocks (w = d q per block of 32 inputs, q in -127..127) run by the W8A8 kernel:
    the w4a8 precision's LM head, and any Q8_0 tensor of its file, kept as shipped."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, act_dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % BLOCK:
            raise ValueError(f"w8a8: {self.in_features} input features are not a multiple of {BLOCK}")
        self.act_dtype, self.min_rows = act_dtype, 1
        packed, scales = _pack_q8(q, d)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_q8_0(cls, q, d, bias, act_dtype) -> Q8BlockLinear:
        return cls(q, d, bias, act_dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, act_dtype) -> Q8BlockLinear:
        """Q8_0's scheme on a float weight [out, in]: per block, d = max|w| / 127 and q = round(w / d); d kept in
        float16, as the file format stores it."""
        w = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
        d = w.abs().amax(-1) / 127
        q = (w / d.clamp_min(1e-30)[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(weight.shape), d, bias, act_dtype)

    @classmethod
    def concat(cls, layers: list[Q8BlockLinear]) -> Q8BlockLinear:
        """One layer computing `layers` side by side (_TiledLinear._concat_tiles)."""
        return cls._concat_tiles(layers, ("packed", "scales"), "w8a8")

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.spec_batch.w8a8_linear(rows, self.packed, self.scales)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (any shape) in fp32, read from the tiles: a tied input embedding's lookup, each
        element (q - 128) * d in one native call (a dozen indexing operators from Python cost ~0.1 ms a step)."""
        return torch.ops.spec_batch.q8_embedding(ids, self.packed, self.scales)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32."""
        return self.embedding_rows(torch.arange(self.out_features, device=self.packed.device))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8 blocks of {BLOCK}"
