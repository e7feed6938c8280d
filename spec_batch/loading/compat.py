"""The loading layer's one door to the internals of transformers and torch: every private name it builds on is
imported (or mirrored) here and nowhere else in loading/.

Tested with the transformers minor version pyproject.toml pins; tests/loading/test_patches_active.py fails when a
patch is silently off on the default model (the attention in use, the KV layer class, one call per fused group).
- Attention: cpu_attention.py registers its implementations with `AttentionInterface` and their masks with
  `AttentionMaskInterface` (`sdpa_mask`), and falls back to `sdpa_attention_forward`.
- GGUF: `gguf_rope_rows` mirrors a private of transformers' GGUF loader.
- Kernels: `cxx11_abi` reads torch's C++ ABI flag to build against its headers (kernels/build.py).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def gguf_rope_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order transformers gives llama's attn_q / attn_k when it loads a GGUF file (a copy of
    LlamaTensorProcessor._reverse_permute_weights, which is private): llama.cpp's converter permuted them."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def cxx11_abi() -> int:
    """torch's _GLIBCXX_USE_CXX11_ABI (1 or 0): a library built against torch's headers must use the same."""
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


__all__ = [
    "AttentionInterface",
    "AttentionMaskInterface",
    "cxx11_abi",
    "gguf_rope_rows",
    "sdpa_attention_forward",
    "sdpa_mask",
]
