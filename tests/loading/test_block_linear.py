"""The W4A8 kernel (loading/kernels/block_linear.cpp): it computes the blocks' own weights, a row's outputs are the
same bits at every row count and beside any other rows, its AVX2 and portable paths agree bit for bit, and layers
concatenate (fused q/k/v, gate/up) without changing a bit."""

from __future__ import annotations

import pytest
import torch

from spec_batch.loading.block_linear import BlockLinear
from spec_batch.loading.kernels import native_ops

pytestmark = pytest.mark.skipif(not native_ops(), reason="no C++ compiler: the native kernels cannot be built here")


def _layer(out_features: int, in_features: int, seed: int = 0) -> BlockLinear:
    gen = torch.Generator().manual_seed(seed)
    return BlockLinear.quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, None, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 576), (200, 96), (64, 1536)])
def test_a_row_is_the_same_bits_at_every_row_count_and_on_both_paths(dtype, shape):
    layer = _layer(*shape)
    x = torch.randn(37, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    every = layer(x)
    assert every.dtype == dtype and every.shape == (37, shape[0])
    for n in (1, 2, 3, 4, 5, 8, 17):
        assert torch.equal(layer(x[:n]), every[:n]), n
    assert torch.equal(layer(x[20:21]), every[20:21])
    portable = torch.ops.spec_batch.w4a8_linear(x, layer.packed, layer.scales, layer.minimums, True)
    assert torch.equal(portable[:, : shape[0]].to(dtype), every)


def test_it_computes_the_blocks_weights_up_to_the_activations_int8_rounding():
    layer = _layer(576, 1536)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(2))
    want = x @ layer.dequantized().t()
    assert (layer(x) - want).abs().max() < 0.02 * want.abs().max()


def test_q4_0_and_q4_1_blocks_are_taken_as_they_are():
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.uint8)
    d, m = torch.rand(16, 2, generator=gen).half(), -torch.rand(16, 2, generator=gen).half()
    blocks = q.float().view(16, 2, 32)
    q4_1 = BlockLinear.from_q4_1(q, d, m, None, torch.float32).dequantized()
    assert torch.equal(q4_1, (blocks * d.float()[..., None] + m.float()[..., None]).view(16, 64))
    q4_0 = BlockLinear.from_q4_0(q, d, None, torch.float32).dequantized()
    assert torch.equal(q4_0, ((blocks - 8) * d.float()[..., None]).view(16, 64))


def test_concatenated_layers_give_the_same_bits_as_each_layer():
    parts = [_layer(576, 576, 4), _layer(192, 576, 5), _layer(192, 576, 6)]
    fused = BlockLinear.concat(parts)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="multiples of 8"):
        BlockLinear.concat([_layer(12, 64), _layer(8, 64)])
