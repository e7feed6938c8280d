"""A token's logits do not depend on the step that computes it: one token at a time, or inside a verify step of
several tokens, beside other ragged rows, after a rollback -- bit for bit, at every weight storage and compute dtype
the CPU offers (loading/cpu_attention.py: attention computes in float64 there)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_batch.core.kv_batch import KVBatch, left_padded
from spec_batch.loading.cpu_attention import use_gqa_attention
from spec_batch.loading.cpu_linear import pack_linear_weights
from spec_batch.loading.fused_projections import fuse_projections
from spec_batch.loading.weights import quantize_model

CPU = torch.device("cpu")
PROMPT, OTHER, TOKENS = [5, 9, 11, 3, 7, 1, 30, 2, 17], [8, 2, 6], [4, 12, 13, 14, 40]


def _model(weights: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(7)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval().to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # sharp logits: the kernels' bf16 inputs see real differences
    if weights == "full":
        pack_linear_weights(model)
    else:
        quantize_model(model, weights, torch.bfloat16)
    fuse_projections(model)
    assert use_gqa_attention(model)
    return model


def _one_at_a_time(model) -> torch.Tensor:
    kv = KVBatch(model, CPU, 1)
    ids, valid = left_padded([PROMPT], 0, CPU)
    out = []
    with torch.inference_mode():
        kv.forward(ids, valid)
        for token in TOKENS:
            out.append(kv.forward(torch.tensor([[token]]), torch.ones(1, 1, dtype=torch.bool))[0, -1])
    return torch.stack(out)


def _in_a_verify_step(model) -> torch.Tensor:
    """Beside a shorter row, after two rejected tokens (a hole in the cache), all tokens in one step."""
    kv = KVBatch(model, CPU, 2)
    ids, valid = left_padded([PROMPT, OTHER], 0, CPU)
    with torch.inference_mode():
        kv.forward(ids, valid)
        kv.forward(torch.tensor([[50, 51], [52, 53]]), torch.ones(2, 2, dtype=torch.bool))
        kv.rollback(torch.tensor([2, 1]))
        step = torch.tensor([TOKENS, [60, 61, 0, 0, 0]])
        return kv.forward(step, step != 0)[0]


@pytest.mark.parametrize(
    "weights,dtype",
    [
        ("full", torch.float32),
        ("full", torch.bfloat16),
        ("int4", torch.float32),
        ("int8", torch.float32),
        ("int4", torch.bfloat16),
    ],
)
def test_a_tokens_logits_are_the_same_bits_in_any_step(weights, dtype):
    model = _model(weights, dtype)
    alone, verified = _one_at_a_time(model), _in_a_verify_step(model)
    assert torch.equal(alone, verified), (alone - verified).abs().max()


def test_the_cache_is_kept_in_float64_and_attention_returns_the_models_dtype():
    model = _model("int4", torch.float32)
    kv = KVBatch(model, CPU, 1)
    with torch.inference_mode():
        logits = kv.forward(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool))
    assert kv.cache.layers[0].keys.dtype == torch.float64
    assert logits.dtype == torch.float32
