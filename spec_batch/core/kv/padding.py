"""Which positions of a forward's [rows, width] input are real tokens, for layers that can skip the rest.

A verify step is a dense [rows, 1 + longest draft] batch: a row with a short draft (or none) is padded to the
longest one, and on a CPU every padded position costs as much as a real one in each linear layer (at batch 8
in fp32 those layers are compute-bound). KVBatch.forward publishes its `valid` mask here for the duration of
the model call; a layer that honours it (loading/cpu_linear.PackedLinear, marked `skips_padding = True`)
computes only the real positions and returns zeros at the padded ones, which no later step reads (the padded
positions are masked out of attention and their logits are never verified). The hint is per thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_local = threading.local()


@dataclass(frozen=True)
class RealPositions:
    shape: tuple[int, int]  # [rows, width] of the forward's input
    index: torch.Tensor  # flat indices (row * width + column) of the real tokens

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, width, ...] -> [N, ...]: the real positions only, in row-major order."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index)

    def scatter(self, real: torch.Tensor) -> torch.Tensor:
        """gather's inverse: real [N, ...] -> [rows, width, ...] with zeros at the padded positions."""
        out = real.new_zeros(self.shape[0] * self.shape[1], *real.shape[1:])
        out.index_copy_(0, self.index, real)
        return out.view(*self.shape, *real.shape[1:])


def current() -> RealPositions | None:
    """The real positions of the forward in progress on this thread, or None (every position is real)."""
    return getattr(_local, "positions", None)


@contextlib.contextmanager
def real_positions(valid: torch.Tensor) -> Iterator[None]:
    """Publishes valid [rows, width] (True on real tokens) while the block runs; nothing if all are real."""
    index = valid.reshape(-1).nonzero().squeeze(1)
    if index.numel() == valid.numel():
        yield
        return
    previous = current()
    _local.positions = RealPositions(tuple(valid.shape), index)
    try:
        yield
    finally:
        _local.positions = previous


def skips_padding(model: torch.nn.Module) -> bool:
    """Some layer of the model computes only the real positions (its cost follows the real tokens, not the
    padded width)."""
    return any(getattr(m, "skips_padding", False) for m in model.modules())
