"""Projections that read the same input, computed in one kernel call: attention's q/k/v and the MLP's gate/up.

A decode step of a Llama-family model makes 7 matrix products a layer, each small on the default model (576
wide). At batch 1 on a CPU a call's fixed cost (the kernel's thread fork and join, the layer's Python) is a large
share of each; fusing q/k/v into one call and gate/up into another leaves 4 a layer (210 -> 120 a step on the
default model), as vLLM's qkv_proj and gate_up_proj do.

Every kernel here computes an output column as the same dot product whatever other columns are computed with it,
so fused results equal the separate ones bit for bit: `fuse_projections` checks that on random rows at several
widths and leaves a group separate where it does not hold. Outputs of a model therefore do not change.

The model's own forward (Hugging Face's) still calls q_proj, k_proj and v_proj one by one on the same input:
each becomes a FusedPart that computes its whole group on the first call and hands out its slice; the group's
output is dropped once every part has read it. The state is per thread, so two threads may share a model.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import nn

from .block_linear import BlockLinear, Q8BlockLinear
from .cpu_linear import PackedLinear
from .quant_linear import Int4Linear, Int8Linear, require_concatenable

__all__ = ["GROUPS", "FusedGroup", "FusedPart", "fuse_projections"]

# (parent's attribute for the fused layer, the projections it replaces): vLLM's names
GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
_CHECK_ROWS = (1, 3, 4, 9, 17)


def _concat_linear(layers: list[nn.Linear]) -> nn.Linear:
    require_concatenable(layers, ("in_features",), "linear")
    first = layers[0].weight
    fused = nn.Linear(
        first.shape[1],
        sum(l.out_features for l in layers),
        bias=layers[0].bias is not None,
        device=first.device,
        dtype=first.dtype,
    )
    fused.weight = nn.Parameter(torch.cat([l.weight.detach() for l in layers]), requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([l.bias.detach() for l in layers]), requires_grad=False)
    return fused


def _concat_packed(layers: list[PackedLinear]) -> PackedLinear:
    require_concatenable(layers, ("in_features",), "packed")
    return PackedLinear(_concat_linear([l.plain() for l in layers]), keep_weight=False)


_CONCAT: dict[type, Callable[[list], nn.Module]] = {
    nn.Linear: _concat_linear,
    PackedLinear: _concat_packed,
    Int4Linear: Int4Linear.concat,
    Int8Linear: Int8Linear.concat,
    BlockLinear: BlockLinear.concat,
    Q8BlockLinear: Q8BlockLinear.concat,
}


class FusedGroup(nn.Module):
    """One fused layer and the widths of its parts; computes the group once per input."""

    def __init__(self, fused: nn.Module, sizes: list[int]):
        super().__init__()
        self.fused, self.sizes = fused, sizes
        self._state = threading.local()

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        # the same tensor object, still held by us, is the same input (HF passes one tensor to all parts)
        if getattr(state, "input", None) is not x:
            state.input, state.outputs = x, self.fused(x).split(self.sizes, dim=-1)
            state.unread = set(range(len(self.sizes)))
        out = state.outputs[index]
        state.unread.discard(index)
        if not state.unread:
            state.input = state.outputs = None
        return out

    def __deepcopy__(self, memo: dict) -> FusedGroup:  # a thread-local state does not copy: a new, empty one
        return FusedGroup(copy.deepcopy(self.fused, memo), list(self.sizes))


class FusedPart(nn.Module):
    """Stands where one projection was: its slice of the group's output."""

    def __init__(self, group: FusedGroup, index: int, layer: nn.Module):
        super().__init__()
        self.__dict__["group"] = group  # not a submodule: the parent holds the group once
        self.index = index
        self.in_features, self.out_features = layer.in_features, layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only (meta) stand-in, as quant_linear's layers have."""
        return torch.empty(self.out_features, self.in_features, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of the fused layer, out_features={self.out_features}"


def _probe_input(layer: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of inputs the layer takes: its weight's (quantized layers: their activations')."""
    if isinstance(layer, (BlockLinear, Q8BlockLinear)):
        return layer.act_dtype, layer.scales.device
    if isinstance(layer, (Int4Linear, Int8Linear)):
        return layer.act_dtype, layer.scales_and_zeros.device if isinstance(layer, Int4Linear) else layer.scales.device
    weight = layer.packed if isinstance(layer, PackedLinear) else layer.weight
    return weight.dtype, weight.device


def _same_bits(layers: list[nn.Module], fused: nn.Module) -> bool:
    dtype, device = _probe_input(layers[0])
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in _CHECK_ROWS:
            x = torch.randn(rows, layers[0].in_features, generator=gen).to(device, dtype)
            if not torch.equal(torch.cat([l(x) for l in layers], dim=-1), fused(x)):
                return False
    return True


def _fuse(parent: nn.Module, group_name: str, names: tuple[str, ...]) -> bool:
    layers = [getattr(parent, n, None) for n in names]
    kind = type(layers[0])
    if kind not in _CONCAT or any(type(l) is not kind for l in layers):
        return False
    try:
        fused = _CONCAT[kind](layers)
    except (ValueError, RuntimeError):
        return False  # layers that do not concatenate (shapes, biases, group sizes, dtypes, devices)
    if not _same_bits(layers, fused):
        return False
    group = FusedGroup(fused, [l.out_features for l in layers])
    setattr(parent, group_name, group)
    for index, (name, layer) in enumerate(zip(names, layers)):
        setattr(parent, name, FusedPart(group, index, layer))
    return True


def fuse_projections(model: nn.Module) -> int:
    """Fuses every q/k/v and gate/up group of a loaded model in place, where its layers are of one kind and the
    fused results equal the separate ones bit for bit; returns how many groups were fused."""
    fused = 0
    for parent in list(model.modules()):
        for group_name, names in GROUPS:
            if all(isinstance(getattr(parent, n, None), nn.Module) for n in names):
                fused += _fuse(parent, group_name, names)
    return fused
