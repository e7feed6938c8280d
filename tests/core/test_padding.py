"""The real-positions hint a forward publishes for layers that can skip padding (core/kv/padding.py)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from spec_batch.core.kv import padding


def test_real_positions_are_published_for_the_block_only():
    valid = torch.tensor([[True, True, False], [True, False, False]])
    assert padding.current() is None
    with padding.real_positions(valid):
        real = padding.current()
        assert real is not None
        assert real.shape == (2, 3) and real.index.numel() == 3
        assert real.index.tolist() == [0, 1, 3]  # flat row * width + column of each real token
    assert padding.current() is None


def test_nothing_is_published_when_every_position_is_real():
    with padding.real_positions(torch.ones(2, 4, dtype=torch.bool)):
        assert padding.current() is None


def test_nested_blocks_restore_the_outer_hint():
    outer, inner = torch.tensor([[True, False]]), torch.tensor([[True, True, False]])
    with padding.real_positions(outer):
        with padding.real_positions(inner):
            assert padding.current().shape == (1, 3)
        assert padding.current().shape == (1, 2)


def test_the_hint_is_per_thread():
    seen: list[object] = []
    with padding.real_positions(torch.tensor([[True, False]])):
        t = threading.Thread(target=lambda: seen.append(padding.current()))
        t.start()
        t.join()
    assert seen == [None]


def test_skips_padding_looks_for_a_layer_that_says_so():
    class Skipping(nn.Linear):
        skips_padding = True

    assert not padding.skips_padding(nn.Sequential(nn.Linear(2, 2)))
    assert padding.skips_padding(nn.Sequential(nn.Linear(2, 2), Skipping(2, 2)))
