"""The last dimension's argmax, as `torch.argmax(x, dim=-1)` gives it (the first maximum; a NaN counts as the
largest), the choice of every greedy row and of every exponential-race sample.

Where the native CPU kernels are loaded (loading/kernels/argmax.cpp) float32 rows on the CPU go through their
vectorized pass, split over the threads: torch's CPU argmax reads a row one element at a time, ~27 us for the
default model's 49,152 logits and ~210 us for 16 rows, each step. Elsewhere (CUDA, other dtypes, no kernels) it is
torch's. The two give the same indices (tests/core/test_argmax.py).
"""

from __future__ import annotations

from typing import Any

import torch

_native: Any = None  # the kernels' operator once found (they may load after this module)


def last_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension: [..., V] -> int64 [...]."""
    global _native
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0:
        if _native is None:
            _native = getattr(torch.ops.spec_batch, "argmax_last", None)
        if _native is not None:
            return _native(x)
    return x.argmax(dim=-1)
