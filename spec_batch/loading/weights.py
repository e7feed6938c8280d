"""The weight storage choice of a target or draft: full | int8 | int4 | w4a8 | auto, and putting it into a loaded model.

- full: the weights in the model's dtype (GGUF files dequantized), packed for oneDNN on the CPU (cpu_linear.py).
- int4: every linear layer group-wise int4 (quant_linear.Int4Linear). A GGUF file's Q4_0/Q4_1 tensors are used as
  they ship; its Q8_0 tensors stay int8; other tensors (and Hugging Face models) are quantized at load from
  their float weights, with a notice. The LM head is int8 (as gpt-fast and llama.cpp keep it wider; w4a8's: W8A8).
- int8: every linear layer per-channel int8 (quant_linear.Int8Linear); Q8_0 tensors are re-expressed with one
  scale per row (the kernel takes no group scales); everything else is quantized at load.
- w4a8: as int4, but the Q4 blocks run in the native W4A8 kernel (block_linear.BlockLinear: activations rounded
  to int8 per block of 32, integer dot products), CPU only, where the native kernels build (kernels/); fastest on
  the CPUs measured (docs/weights.md). The LM head and any Q8_0 tensor run as W8A8 (block_linear.Q8BlockLinear:
  Q8_0 blocks as shipped, or quantized so at load, against the same int8 activations; llama.cpp's computation).
- auto: the fastest exact configuration measured (docs/benchmarks.md): w4a8 on the CPU where the native kernels
  build and the compute dtype is float32 or bfloat16, full elsewhere (CUDA, no C++ compiler, float16); see
  `auto_weights`. The default of SPEC_BATCH_WEIGHTS (the CLI, the server, workers); the Python API's `weights=None`
  stays `full`, the reference.

`dtype` stays the compute dtype (residual stream, norms, attention, KV cache). torch's int4 and int8 CPU kernels are
fast with bfloat16 activations only (fp32 takes a reference path 10-25x slower, docs/weights.md), so the quantized
layers round their inputs to bfloat16 for the kernel and return the model's dtype. In float32 (the default) a
token's logits then do not depend on its batch beyond fp32 rounding, as with full weights; in bfloat16 the
attention's rounding differs between batch shapes (as for `full` bfloat16), which can flip near-ties.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import InvalidParameterError
from .block_linear import BlockLinear, Q8BlockLinear
from .quant_linear import Int4Linear, Int8Linear, QuantEmbedding

__all__ = ["WEIGHT_CHOICES", "Precision", "auto_weights", "quantize_model", "resolve_precision", "resolve_weights_name"]

log = logging.getLogger(__name__)

WEIGHT_CHOICES = ("full", "int8", "int4", "w4a8", "auto")
QUANTIZED = ("int8", "int4", "w4a8")
BLOCKS = ("w4a8",)  # run by the native kernels (loading/kernels/): CPU only
KERNEL_DTYPE = torch.bfloat16  # the activations of the int4/int8 kernels, whatever the model's dtype
QUANTIZED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Precision:
    """The effective (weights, dtype) pair a model runs at: what jobs record and stats show."""

    weights: str
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def label(self) -> str:
        return f"{self.weights}/{self.dtype_name}"


def resolve_weights_name(weights: str | None) -> str:
    """None -> 'full'; otherwise one of WEIGHT_CHOICES (case-insensitive), else InvalidParameterError."""
    if weights is None:
        return "full"
    key = str(weights).strip().lower()
    if key not in WEIGHT_CHOICES:
        raise InvalidParameterError(f"weights {weights!r} is not supported; use one of {', '.join(WEIGHT_CHOICES)}")
    return key


def dtype_is_auto(dtype: str | torch.dtype | None) -> bool:
    return dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto")


def resolve_precision(
    weights: str | None, dtype: str | torch.dtype | None, device: torch.device, resolved_dtype: torch.dtype
) -> Precision:
    """The effective pair for a requested (weights, dtype): resolved_dtype is dtype as load.resolve_dtype made it.
    auto: `auto_weights`."""
    name = resolve_weights_name(weights)
    if name == "auto":
        name = auto_weights(device, resolved_dtype)
    if name in QUANTIZED and resolved_dtype not in QUANTIZED_DTYPES:
        raise InvalidParameterError(
            f"weights={name!r} computes in float32 or bfloat16 (its kernels take bfloat16 activations), not "
            f"{str(resolved_dtype).removeprefix('torch.')}; pass dtype='float32' (the default) or 'bfloat16'"
        )
    if name in BLOCKS and device.type != "cpu":
        raise InvalidParameterError(f"weights={name!r} runs on the CPU only (its kernels are native CPU code)")
    return Precision(name, resolved_dtype)


def auto_weights(device: torch.device, dtype: torch.dtype) -> str:
    """What `auto` resolves to: w4a8 on the CPU where the native kernels load (settings' SPEC_BATCH_COMPILE) and
    `dtype` is one they compute in; full otherwise. w4a8 decodes fastest here, plainly and speculatively, at batch 1
    and 8 (docs/benchmarks.md); full is the only choice on CUDA without a C++ compiler."""
    if device.type != "cpu" or dtype not in QUANTIZED_DTYPES:
        return "full"
    from ..settings import get_settings
    from .kernels.build import KernelBuildError, native_ops

    try:
        return "w4a8" if native_ops(get_settings().compile) else "full"
    except KernelBuildError:  # SPEC_BATCH_COMPILE=on without a working compiler: loading says so; auto is full
        return "full"


@dataclass
class QuantReport:
    """What quantize_model did: layers per storage and the notices it logged."""

    counts: dict[str, int] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    def add(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1


def plain_linears(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """name -> (parent, attribute, linear) for every plain nn.Linear of the model."""
    out = {}
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if type(child) is nn.Linear:
                out[f"{parent_name}.{attr}" if parent_name else attr] = (parent, attr, child)
    return out


def _from_file(name: str, linear: nn.Linear, tensor, weights: str, act_dtype, device) -> nn.Module | None:
    """The layer built from its GGUF blocks, or None where they do not fit the choice or disagree with the
    loaded weight (a layout this reader does not know: then the layer is quantized from the loaded weight)."""
    from .gguf_quant import dequantize

    want = linear.weight.detach().float()
    got = dequantize(tensor)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
        return None
    bias = linear.bias
    if tensor.kind == "Q8_0" and weights == "w4a8":  # Q8_0 blocks are 32 wide: the kernel takes them as they are
        return Q8BlockLinear.from_q8_0(tensor.q, tensor.d, bias, act_dtype)
    if tensor.kind == "Q8_0":
        return Int8Linear.from_q8_0(tensor.q, tensor.d, bias, act_dtype, device=device)
    if weights == "int8" or name == "lm_head":
        return None  # int8 asked for, or a Q4 LM head: quantized per channel from the weight
    if weights == "w4a8":
        if tensor.kind == "Q4_1":
            return BlockLinear.from_q4_1(tensor.q, tensor.d, tensor.m, bias, act_dtype)
        return BlockLinear.from_q4_0(tensor.q, tensor.d, bias, act_dtype)
    if tensor.kind == "Q4_1":
        return Int4Linear.from_q4_1(tensor.q, tensor.d, tensor.m, bias, act_dtype, device=device)
    return Int4Linear.from_q4_0(tensor.q, tensor.d, bias, act_dtype, device=device)


def _from_weight(name: str, linear: nn.Linear, weights: str, act_dtype, device) -> tuple[nn.Module, str]:
    if weights == "w4a8" and linear.in_features % 32 == 0:
        if name == "lm_head":
            return Q8BlockLinear.quantize(linear.weight, linear.bias, act_dtype), "w8a8"
        return BlockLinear.quantize(linear.weight, linear.bias, act_dtype), "w4a8"
    if weights == "int4" and name != "lm_head" and linear.in_features % 32 == 0:
        return Int4Linear.quantize(linear.weight, linear.bias, act_dtype, device=device), "int4"
    return Int8Linear.quantize(linear.weight, linear.bias, act_dtype, device=device), "int8"


def quantize_model(
    model: nn.Module,
    weights: str,
    act_dtype: torch.dtype = KERNEL_DTYPE,
    gguf_path: Path | None = None,
    entry_dir: Path | None = None,
) -> QuantReport:
    """Replaces every nn.Linear of a loaded model by its weight-only quantized form, in place (weights: int4 | int8 |
    w4a8; w4a8 needs the native kernels loaded).
    A tied input embedding reads the int8 LM head's rows instead of keeping its own copy."""
    report = QuantReport()
    linears = plain_linears(model)
    device = next(iter(linears.values()))[2].weight.device if linears else torch.device("cpu")
    kept, others = {}, {}
    if gguf_path is not None:
        from .gguf_quant import cached_quantized_linears

        kept, others = cached_quantized_linears(Path(gguf_path), entry_dir, list(linears), model.config)
    embeddings = model.get_input_embeddings()
    model_dtype = embeddings.weight.dtype if embeddings is not None else act_dtype
    head = model.get_output_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    for name, (parent, attr, linear) in linears.items():
        layer = _from_file(name, linear, kept[name], weights, act_dtype, device) if name in kept else None
        kind = f"{kept[name].kind} as shipped" if layer is not None else ""
        if layer is None:
            layer, kind = _from_weight(name, linear, weights, act_dtype, device)
            kind = f"{kind} quantized at load" + (f" (GGUF {others[name]})" if name in others else "")
        setattr(parent, attr, layer)
        report.add(kind)
    if tied and isinstance(model.get_output_embeddings(), (Int8Linear, Q8BlockLinear)):
        model.set_input_embeddings(QuantEmbedding(model.get_output_embeddings(), model_dtype, embeddings.padding_idx))
    if others:
        types = sorted(set(others.values()))
        report.notices.append(
            f"GGUF tensor types {types} are not kept as they ship (only {', '.join(('Q4_0', 'Q4_1', 'Q8_0'))}): "
            f"{len(others)} layer(s) were dequantized and re-quantized to {weights} at load"
        )
    for notice in report.notices:
        log.warning(notice)
    log.info("weights %s: %s", weights, report.counts)
    model.spec_batch_quant_report = report  # what each layer became (tests and `spec-batch models` read it)
    return report
