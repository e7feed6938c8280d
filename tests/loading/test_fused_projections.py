"""q/k/v and gate/up computed in one kernel call each: the same bits as the separate layers, for every layer kind
a model can hold (plain, oneDNN-packed, int4, int8)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from spec_batch.loading.cpu_linear import PackedLinear, pack_linear_weights
from spec_batch.loading.fused_projections import FusedGroup, FusedPart, fuse_projections
from spec_batch.loading.quant_linear import Int4Linear, Int8Linear
from spec_batch.loading.weights import quantize_model


def _llama(storage: str) -> LlamaForCausalLM:
    torch.manual_seed(5)
    # k/v 64 wide: the CPU's int4 layout concatenates at multiples of 64 outputs
    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config).eval()
    if storage == "packed":
        assert pack_linear_weights(model)
    elif storage in ("int4", "int8"):
        quantize_model(model, storage, torch.bfloat16)
    return model


KINDS = {"plain": nn.Linear, "packed": PackedLinear, "int4": Int4Linear, "int8": Int8Linear}


@pytest.mark.parametrize("storage", list(KINDS))
def test_fused_groups_compute_the_same_bits(storage):
    model = _llama(storage)
    separate = copy.deepcopy(model)
    assert fuse_projections(model) == 4  # two layers x (qkv, gate_up)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, FusedGroup) and isinstance(attn.qkv_proj.fused, KINDS[storage])
    assert isinstance(mlp.gate_up_proj.fused, KINDS[storage]) and isinstance(mlp.up_proj, FusedPart)
    assert attn.qkv_proj.fused.out_features == 128 + 64 + 64 and attn.k_proj.out_features == 64
    ids = torch.tensor([[1, 5, 9, 20, 7, 3], [4, 4, 8, 2, 60, 1]])
    with torch.inference_mode():
        for width in (1, 6):
            assert torch.equal(model(ids[:, :width]).logits, separate(ids[:, :width]).logits)


def test_a_fused_model_deep_copies_into_its_own_groups():
    model = _llama("packed")
    fuse_projections(model)
    clone = copy.deepcopy(model)
    attn, cloned = model.model.layers[1].self_attn, clone.model.layers[1].self_attn
    assert cloned.q_proj.group is cloned.qkv_proj and cloned.qkv_proj is not attn.qkv_proj
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        assert torch.equal(clone(ids).logits, model(ids).logits)


def test_a_part_called_on_a_new_input_computes_it_and_threads_keep_their_own():
    model = _llama("plain")
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    gate, up = mlp.gate_proj, mlp.up_proj
    want_gate, want_up = gate.group.fused.weight[:128], gate.group.fused.weight[128:]
    x, y = torch.randn(2, 128), torch.randn(3, 128)
    torch.testing.assert_close(gate(x), x @ want_gate.T)
    torch.testing.assert_close(gate(y), y @ want_gate.T)  # x's up never read: y is computed anew
    torch.testing.assert_close(up(y), y @ want_up.T)
    seen = {}

    def other_thread() -> None:
        seen["up"] = up(x)

    gate(y)  # this thread now holds y's group output, unread by up
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    torch.testing.assert_close(seen["up"], x @ want_up.T)
    torch.testing.assert_close(up(y), y @ want_up.T)


def test_layers_of_different_kinds_stay_separate():
    model = _llama("plain")
    attn = model.model.layers[0].self_attn
    attn.k_proj = Int8Linear.quantize(attn.k_proj.weight, None, torch.bfloat16)
    assert fuse_projections(model) == 3  # layer 0's q/k/v stays as it is
    assert isinstance(attn.k_proj, Int8Linear) and not hasattr(attn, "qkv_proj")


def test_projections_with_and_without_a_bias_stay_separate():
    model = _llama("plain")
    mlp = model.model.layers[1].mlp
    mlp.gate_proj.bias = nn.Parameter(torch.zeros(mlp.gate_proj.out_features), requires_grad=False)
    assert fuse_projections(model) == 3  # layer 1's gate/up stays as it is
    assert type(mlp.gate_proj) is nn.Linear and not hasattr(mlp, "gate_up_proj")


def test_int4_layers_that_do_not_fill_the_packed_blocks_stay_separate():
    parts = [Int4Linear.quantize(torch.randn(out, 64), None, torch.bfloat16) for out in (32, 64)]
    with pytest.raises(ValueError, match="multiples of 64"):
        Int4Linear.concat(parts)
    fused = Int4Linear.concat(parts[::-1])  # 64 then 32: the last part may end a block early
    x = torch.randn(3, 64)
    assert torch.equal(fused(x), torch.cat([parts[1](x), parts[0](x)], dim=-1))
