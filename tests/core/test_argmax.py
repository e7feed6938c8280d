"""core/argmax.py: the native argmax gives torch.argmax's indices (the first maximum, the first NaN)."""

from __future__ import annotations

import pytest
import torch

from spec_batch.core.argmax import last_argmax
from spec_batch.loading.kernels import native_ops

pytestmark = pytest.mark.skipif(not native_ops(), reason="no C++ compiler: the native kernels cannot be built here")


def _same(x: torch.Tensor) -> None:
    want = x.argmax(dim=-1)
    for got in (last_argmax(x), torch.ops.spec_batch.argmax_last(x)):  # through core, and the kernel itself
        assert got.dtype == torch.long and got.shape == want.shape
        assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 31, 48, 1000, 49152 + 3])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_random_rows_give_torchs_indices(vocab, rows):
    gen = torch.Generator().manual_seed(vocab * 31 + rows)
    _same(torch.randn(rows, vocab, generator=gen))


def test_ties_take_the_first_maximum_in_any_lane_and_in_the_tail():
    x = torch.zeros(4, 70)
    x[0, [3, 19, 35]] = 5.0  # the same value in three lanes: the earliest index
    x[1, [40, 66]] = 7.0  # the vector body and the tail tie: the body's
    x[2, [67, 68]] = 9.0  # a tie inside the tail
    x[3, 0], x[3, 16] = -0.0, 0.0  # a signed zero ties with zero
    _same(x)
    _same(torch.full((2, 40), float("-inf")))
    _same(-torch.arange(100.0).repeat(2, 1))


@pytest.mark.parametrize("where", [0, 7, 16, 33, 63, 64, 65])
def test_a_nan_wins_wherever_it_is_and_the_first_nan_over_a_later_one(where):
    x = torch.randn(2, 66, generator=torch.Generator().manual_seed(where))
    x[0, where] = float("nan")
    x[1, where] = float("nan")
    x[1, 65] = float("nan")
    x[1, 1] = float("inf")
    _same(x)


def test_any_shape_strides_and_the_fallbacks():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 200, generator=gen)
    _same(logits)  # [B, k + 1, V], as a verify step's
    _same(logits[:, 0])  # a strided slice (made contiguous on the way)
    _same(logits[:, :, :150])  # a narrowed last dimension
    _same(torch.randn(0, 40))  # no rows
    _same(logits.double())  # not float32: torch's own
    _same(logits.to(torch.bfloat16))
