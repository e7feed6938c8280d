"""The W4A8 kernel (weights=w4a8) against torch's int4 kernel (weights=int4) and int8 LM head, on the default
model's layer shapes, side by side in one process.

Question: what does one forward's linear work cost at 1, 8 and 32 rows (plain decoding, a verify step, a batch)?

    .venv/bin/python -m bench.bench_block_linear [--threads 2] [--repeats 7]

Random weights of the default model's shapes (30 layers of q/k/v 960, o 576, gate/up 3072 and down 576 outputs;
an LM head of 49152 outputs); medians of --repeats. Needs the native kernels (a C++ compiler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spec_batch.loading.block_linear import BlockLinear
from spec_batch.loading.kernels import native_ops
from spec_batch.loading.quant_linear import Int4Linear, Int8Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, VOCAB = 30, 49152


def median_ms(fn, repeats: int) -> float:
    """fn's median wall time in ms over `repeats` calls, after one untimed call (bench_attention's too)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _forward(layers: list, xs: list[torch.Tensor]) -> None:
    for _ in range(LAYERS):
        for layer, x in zip(layers, xs):
            layer(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native_ops("on")
    weights = [torch.randn(o, k) * 0.05 for o, k in SHAPES]
    kinds = {
        "w4a8": [BlockLinear.quantize(w, None, torch.float32) for w in weights],
        "int4": [Int4Linear.quantize(w, None, torch.bfloat16) for w in weights],
    }
    head = Int8Linear.quantize(torch.randn(VOCAB, 576) * 0.05, None, torch.bfloat16)
    print(f"{'rows':>4}  {'w4a8 30 layers':>15}  {'int4 30 layers':>15}  {'ratio':>6}  {'int8 LM head':>12}")
    with torch.inference_mode():
        for rows in (1, 8, 32):
            xs = [torch.randn(rows, k) for _, k in SHAPES]
            ms = {name: median_ms(lambda ls=ls, xs=xs: _forward(ls, xs), args.repeats) for name, ls in kinds.items()}
            x = torch.randn(rows, 576)
            lm = median_ms(lambda x=x: head(x), args.repeats)
            ratio = ms["int4"] / ms["w4a8"]
            print(f"{rows:>4}  {ms['w4a8']:>12.2f} ms  {ms['int4']:>12.2f} ms  {ratio:>5.2f}x  {lm:>9.2f} ms")


if __name__ == "__main__":
    main()
