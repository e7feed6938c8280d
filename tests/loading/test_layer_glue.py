"""The native operators between a Llama layer's matmuls (loading/kernels/layer_glue.cpp) give the bits of the
Hugging Face code they replace, in every dtype the forward runs, on random inputs and weights; and our forward
uses them on a Llama-family model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from spec_batch.loading.kernels import native_ops
from spec_batch.loading.llama_forward import use_own_forward

pytestmark = pytest.mark.skipif(not native_ops(), reason="no C++ compiler: the native kernels cannot be built")

# (activations, norm weight): the family's models keep both in the compute dtype; a bf16 model may keep fp32 norms
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
SHAPES = [(1, 1, 576), (3, 5, 64), (8, 7, 100)]


def _norm(width: int, weight_dtype: torch.dtype, gen: torch.Generator) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen) * 2)
    return norm.to(weight_dtype)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype,weight_dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_and_the_residual_add_give_hugging_faces_bits(dtype, weight_dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    norm = _norm(shape[-1], weight_dtype, gen)
    x = (torch.randn(shape, generator=gen) * 30).to(dtype)
    delta = (torch.randn(shape, generator=gen) * 3).to(dtype)
    with torch.inference_mode():
        assert _equal(torch.ops.spec_batch.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        total, normed = torch.ops.spec_batch.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        assert _equal(total, x + delta) and _equal(normed, norm(x + delta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,broadcast_cos", [(1, 1, False), (3, 4, False), (2, 6, True)])
def test_the_rotary_embedding_of_fused_heads_gives_hugging_faces_bits(dtype, rows, width, broadcast_cos):
    gen = torch.Generator().manual_seed(rows * 10 + width)
    nq, nk, dim = 4, 2, 64
    heads = (torch.randn(rows, width, nq + 2 * nk, dim, generator=gen) * 4).to(dtype)
    angles = torch.randn(1 if broadcast_cos else rows, width, dim, generator=gen) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.inference_mode():
        q, k, v = torch.ops.spec_batch.rotary_heads(heads, cos, sin, nq, nk)
        split = heads.transpose(1, 2)  # [B, heads, n, D], as Hugging Face's attention holds them
        want_q, want_k = apply_rotary_pos_emb(split[:, :nq], split[:, nq : nq + nk], cos, sin)
    assert _equal(q, want_q) and _equal(k, want_k) and _equal(v, split[:, nq + nk :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_times_up_gives_hugging_faces_bits(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 5, 2 * 96, generator=gen) * 6).to(dtype)
    gate, up = gate_up.split([96, 96], dim=-1)
    with torch.inference_mode():
        assert _equal(torch.ops.spec_batch.silu_mul(gate_up, 96), F.silu(gate) * up)


@pytest.mark.parametrize("weights,plain", [("full", set()), ("w4a8", {"qkv", "o", "gate_up", "down"})])
def test_our_forward_runs_the_glue_and_calls_w4a8_kernels_directly(prepared_llama, weights, plain):
    """The bits of both paths against Hugging Face's: tests/loading/test_llama_forward.py."""
    model = prepared_llama(weights, torch.float32, True, seed=11, layers=2)
    use_own_forward(model, "own")
    forward = model.spec_batch_forward
    assert forward.glue and all(set(part.plain) == plain for part in forward.parts)
