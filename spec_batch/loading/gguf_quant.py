"""GGUF quantized tensors read as they ship: Q4_0 / Q4_1 blocks as int4 groups, Q8_0 blocks as int8 groups.

Block layouts (ggml's, per 32 weights of one row): Q4_0 = fp16 d + 16 bytes of nibbles, weight = d * (q - 8);
Q4_1 = fp16 d + fp16 m + 16 bytes, weight = d * q + m; Q8_0 = fp16 d + 32 int8, weight = d * q. In the 16 bytes,
byte j holds weight j in its low nibble and weight j + 16 in its high one. Read with the `gguf` package's reader
(memory-mapped); nothing is re-quantized here.

llama.cpp's converter permutes the rows of Llama's q and k projections (its rope layout); transformers undoes
it when it loads the file, so the rows are put back in the same order here. Rows are independent of one
another in every block format, so the permutation is exact.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .compat import gguf_rope_rows

__all__ = ["BLOCKS_FILE", "KEPT_TYPES", "GGUFQuantTensor", "cached_quantized_linears", "read_quantized_linears"]

KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK = 32
# Beside the dequantized model.safetensors of a cache entry (gguf_cache.py): the blocks of the kept tensors, so
# that a later load does not parse the GGUF file again (its reader takes ~10-20 s on the default's 49k-token
# vocabulary). Named so that transformers, which loads model.safetensors, never reads it.
BLOCKS_FILE = "quant-blocks.safetensors"


@dataclass
class GGUFQuantTensor:
    """One quantized weight [out, in] of a GGUF file: q (uint8 0..15 for Q4, int8 for Q8_0), per-group d
    (and m for Q4_1), each [out, in / 32]."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)  # [rows, groups, bytes]


def _fp16(blocks: np.ndarray, start: int) -> torch.Tensor:
    raw = np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(raw.astype(np.float32))


def _nibbles(blocks: np.ndarray, start: int) -> torch.Tensor:
    qs = blocks[..., start : start + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, groups, 32]: low nibbles first
    return torch.from_numpy(q.reshape(q.shape[0], -1).astype(np.uint8))


def decode_tensor(kind: str, data: np.ndarray, rows: int) -> GGUFQuantTensor:
    """A GGUF tensor's raw bytes [rows, bytes per row] -> its blocks as tensors."""
    if kind == "Q4_0":
        b = _blocks(data, rows, 18)
        return GGUFQuantTensor(kind, _nibbles(b, 2), _fp16(b, 0))
    if kind == "Q4_1":
        b = _blocks(data, rows, 20)
        return GGUFQuantTensor(kind, _nibbles(b, 4), _fp16(b, 0), _fp16(b, 2))
    if kind == "Q8_0":
        b = _blocks(data, rows, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
        return GGUFQuantTensor(kind, torch.from_numpy(q.copy()), _fp16(b, 0))
    raise ValueError(f"GGUF type {kind} is not kept quantized")


def _permuted(t: GGUFQuantTensor, order: torch.Tensor) -> GGUFQuantTensor:
    return GGUFQuantTensor(t.kind, t.q[order], t.d[order], None if t.m is None else t.m[order])


def read_quantized_linears(
    path: Path, module_names: list[str], config
) -> tuple[dict[str, GGUFQuantTensor], dict[str, str]]:
    """For each HF module name (e.g. 'model.layers.0.self_attn.q_proj', 'lm_head'), its GGUF tensor when the type
    is one of KEPT_TYPES. Returns (kept, others): others maps module name -> GGUF type of the tensors not kept
    (they are used dequantized). A tied LM head maps to 'token_embd'."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.get_field("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "llama"
    arch_enum = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), gguf.MODEL_ARCH.LLAMA)
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    name_map = gguf.get_tensor_name_map(arch_enum, n_layers)
    tensors = {t.name: t for t in reader.tensors}
    kept: dict[str, GGUFQuantTensor] = {}
    others: dict[str, str] = {}
    for module in module_names:
        base = name_map.get_name(module)
        if base is None:
            continue
        tensor = tensors.get(f"{base}.weight")
        if tensor is None and module == "lm_head":
            tensor = tensors.get("token_embd.weight")  # tied output embeddings
        if tensor is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in KEPT_TYPES:
            others[module] = kind
            continue
        rows = int(tensor.shape[-1])  # gguf lists shapes innermost first
        decoded = decode_tensor(kind, tensor.data, rows)
        if arch == "llama" and base.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads if base.endswith(".attn_q") else config.num_key_value_heads
            decoded = _permuted(decoded, gguf_rope_rows(rows, heads))
        kept[module] = decoded
    return kept, others


def dequantize(t: GGUFQuantTensor) -> torch.Tensor:
    """The fp32 weight [out, in] the blocks stand for (what transformers' loader computes)."""
    q = t.q.float().reshape(t.q.shape[0], -1, _BLOCK)
    if t.kind == "Q4_0":
        w = (q - 8) * t.d[..., None]
    elif t.kind == "Q4_1":
        w = q * t.d[..., None] + t.m[..., None]
    else:
        w = q * t.d[..., None]
    return w.reshape(t.q.shape)


def _save_blocks(path: Path, kept: dict[str, GGUFQuantTensor], others: dict[str, str]) -> None:
    """Writes the blocks atomically (a temporary file renamed into place); Q4 nibbles two per byte."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, t in kept.items():
        q = t.q
        if t.kind != "Q8_0":
            q = (q[:, ::2] | (q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.q"], tensors[f"{name}.d"] = q, t.d.contiguous()
        if t.m is not None:
            tensors[f"{name}.m"] = t.m.contiguous()
    meta = {"kinds": json.dumps({n: t.kind for n, t in kept.items()}), "others": json.dumps(others)}
    fd, tmp = tempfile.mkstemp(prefix=".tmp-blocks-", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_blocks(path: Path) -> tuple[dict[str, GGUFQuantTensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        kinds, others = json.loads(meta["kinds"]), json.loads(meta["others"])
        kept = {}
        for name, kind in kinds.items():
            q = f.get_tensor(f"{name}.q")
            if kind != "Q8_0":
                q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1)
            m = f.get_tensor(f"{name}.m") if kind == "Q4_1" else None
            kept[name] = GGUFQuantTensor(kind, q, f.get_tensor(f"{name}.d"), m)
    return kept, others


def cached_quantized_linears(gguf_path: Path, entry_dir: Path | None, module_names: list[str], config):
    """read_quantized_linears, through the blocks file in the cache entry when there is one (and it names the same
    modules); an unreadable blocks file is read again from the GGUF file and rewritten."""
    cache = Path(entry_dir) / BLOCKS_FILE if entry_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            kept, others = _load_blocks(cache)
            if set(kept) | set(others) <= set(module_names):
                return kept, others
        except (OSError, ValueError, KeyError, RuntimeError):
            pass
    kept, others = read_quantized_linears(gguf_path, module_names, config)
    if cache is not None:
        try:
            _save_blocks(cache, kept, others)
        except OSError:
            pass  # a read-only cache: the next load reads the GGUF file again
    return kept, others
