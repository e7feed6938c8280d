"""Prepacked oneDNN weights for the linear layers of a model that runs on the CPU.

Speculation makes the target read several tokens per forward. On a GPU a forward of 9 tokens costs about what
one of 1 token costs; on the CPU, torch's default matmul for a few rows (MKL sgemm) repacks every weight matrix
on each call, so on the default model (1 thread, fp32) a forward of 9 tokens cost 2.2x one of 1 token. oneDNN
with the weight packed once, at load, reads each weight once per forward: 9 tokens cost ~1.35x, 17 tokens ~1.55x
(with cpu_attention.py), and a batch-8 step of 1 token is ~30% faster; plain decoding at batch 1 ran from 8% slower
to 9% faster than MKL's GEMV across the VMs measured. That is what lets a verify step pay on the CPU
(docs/benchmarks.md).

Only models this package loads are packed (a model passed in already loaded is the caller's and left alone).
The results differ from torch's default kernel by rounding only (checked at packing time), as do the results
of any two matmul kernels, or of one kernel at two batch sizes. SPEC_BATCH_PACK_WEIGHTS=0 turns it off (read by
settings; load.py asks before packing).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..core.kv import padding

_DTYPES = (torch.float32, torch.bfloat16)
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None
# Fewer rows than this are computed with zero rows added. oneDNN's one-row kernel rounds differently from its
# kernel for more rows (the default model's down_proj), so a token's logits at batch 1 differed from the same
# token's at batch 8 by ~5e-5; with four rows they are the same bit for bit. Nor is it slower: batch-1 forwards of
# 1-2 tokens measured 0-18% faster, whole batch-1 jobs ~3% (docs/benchmarks.md).
MIN_ROWS = 4


class PackedLinear(nn.Module):
    """nn.Linear with its weight in oneDNN's blocked layout. `weight` is kept only where something else reads it
    (the output embeddings, often tied to the input ones); elsewhere the plain copy is dropped.

    Inside a forward that published its real positions (core/kv/padding.py), only those rows are computed; the
    padded ones are zeros. A row's numbers do not depend on which other rows are computed with it."""

    skips_padding = True

    def __init__(self, linear: nn.Linear, keep_weight: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        self.weight = linear.weight if keep_weight else None

    def plain(self) -> nn.Linear:
        """An nn.Linear with these weights (the plain layout, a new copy unless the weight was kept)."""
        weight = self.weight if self.weight is not None else nn.Parameter(self.packed.to_dense(), requires_grad=False)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = weight, self.bias
        return linear

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # oneDNN's blocked tensors cannot be copied as they are (a deep-copied model is a common draft): repack
        plain = copy.deepcopy(self.plain(), memo)
        return PackedLinear(plain, keep_weight=self.weight is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        real = padding.current()
        if real is None or tuple(x.shape[:-1]) != real.shape:
            if x.numel() >= MIN_ROWS * x.shape[-1]:
                return self._kernel(x)  # any leading dims, any strides
            return self._rows(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return real.scatter(self._rows(real.gather(x)))

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] -> [n, out], with at least MIN_ROWS rows in the kernel call."""
        n = rows.shape[0]
        if n >= MIN_ROWS:
            return self._kernel(rows)
        return self._kernel(torch.cat([rows, rows.new_zeros(MIN_ROWS - n, rows.shape[1])]))[:n]

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN"


def available() -> bool:
    return torch.backends.mkldnn.is_available() and _LINEAR is not None


def _same_results(packed: PackedLinear, linear: nn.Linear) -> bool:
    """The packed layer computes what the plain one does, up to rounding, on a few random rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, linear.in_features, generator=gen).to(linear.weight.dtype)
    with torch.inference_mode():
        want, got = linear(x).float(), packed(x).float()
    tol = 1e-3 if linear.weight.dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1.0))))


def pack_linear_weights(model: nn.Module) -> int:
    """Replaces each nn.Linear of a CPU model in fp32/bf16 by a PackedLinear, in place; returns how many.
    Does nothing (0) where oneDNN is missing or the model is elsewhere or in another dtype."""
    if not available():
        return 0
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu" or child.weight.dtype not in _DTYPES:
                continue
            try:
                packed = PackedLinear(child, keep_weight=child is output)
            except RuntimeError:
                if replaced:
                    raise
                return 0  # this CPU lacks oneDNN's kernel for the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT)
            if replaced == 0 and not _same_results(packed, child):  # the first layer decides for all
                return 0  # this oneDNN build disagrees with torch: keep the plain kernels
            setattr(parent, name, packed)
            replaced += 1
    return replaced
