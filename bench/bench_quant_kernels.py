"""Which weight kernel for which width: one linear layer of the default model's shapes, on the CPU.

Question: per row count (1, 4, 8, 16, 72), how long does a linear layer take with each weight storage --
fp32 and bf16 packed for oneDNN (loading/cpu_linear.PackedLinear, today's path), int4 (torch's
`_weight_int4pack_mm_for_cpu`, group 32, as Q4_0/Q4_1 ship) with bf16 and fp32 activations, and int8
(`_weight_int8pack_mm`, per-channel scales) with fp32 and bf16 activations -- and how many bytes does each keep?

    flock /tmp/specbatch-cpu.lock .venv/bin/python -m bench.bench_quant_kernels [--threads 1] [--rows 1,4,8,16,72]

Prints one line per (shape, kernel, rows): microseconds per call (median of repeats) and weight bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from spec_batch.loading.cpu_linear import PackedLinear
from spec_batch.loading.quant_linear import Int4Linear, Int8Linear

# SmolLM2-135M: attention q/o (576x576), k/v (192x576), MLP gate/up (1536x576), down (576x1536), LM head
SHAPES = {
    "q_proj": (576, 576),
    "k_proj": (192, 576),
    "gate_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def _time(fn, x: torch.Tensor, repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _kernels(out_features: int, in_features: int) -> dict[str, tuple[nn.Module, torch.dtype]]:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
    bf16 = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(linear.weight)
    return {
        "fp32 oneDNN": (PackedLinear(linear, keep_weight=False), torch.float32),
        "bf16 oneDNN": (PackedLinear(bf16, keep_weight=False), torch.bfloat16),
        "int4 bf16-act": (Int4Linear.quantize(linear.weight, None, torch.bfloat16, min_rows=1), torch.bfloat16),
        "int4 fp32-act": (Int4Linear.quantize(linear.weight, None, torch.float32, min_rows=1), torch.float32),
        "int8 fp32-act": (Int8Linear.quantize(linear.weight, None, torch.float32, min_rows=1), torch.float32),
        "int8 bf16-act": (Int8Linear.quantize(linear.weight, None, torch.bfloat16, min_rows=1), torch.bfloat16),
    }


def _bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    if isinstance(module, PackedLinear):  # oneDNN's blocked weight is a plain attribute
        tensors.append(module.packed)
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8,16,72")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--kernels", default="", help="comma-separated substrings of kernel names; all when empty")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads={args.threads} torch={torch.__version__}")
    for shape in args.shapes.split(","):
        out_features, in_features = SHAPES[shape]
        for name, (module, act) in _kernels(out_features, in_features).items():
            if args.kernels and not any(k in name for k in args.kernels.split(",")):
                continue
            line = [f"{shape:9s} {name:14s} {_bytes(module) / 1e6:7.2f} MB"]
            for n in rows:
                x = torch.randn(n, in_features).to(act)
                line.append(f"{n}:{_time(module, x, args.repeats):8.1f}us")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
