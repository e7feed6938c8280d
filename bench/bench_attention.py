"""The native attention kernel (loading/kernels/cpu_attention.cpp) on the default model's head shapes: its vector
path against its portable C++ path, side by side in one process.

Question: what does one step's attention cost (30 layers) at a decode step, a verify step and a long context, at 1, 8
and 16 rows, and how far does the vector path run ahead of the plain C++ one (the same bits: tests check it)?

    .venv/bin/python -m bench.bench_attention [--threads 2] [--repeats 30]

Random queries, keys and values of SmolLM2-135M's shapes (9 query heads sharing 3 key/value heads, 64 wide), every
column visible; medians of --repeats calls. ns per head-column: the time over (rows x query heads x queries x columns).
Needs the native kernels (a C++ compiler).
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_block_linear import median_ms
from spec_batch.loading.kernels import native_ops

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
# (rows, queries a row, columns): decode steps, verify steps of 4 drafts, a long context
SHAPES = [(1, 1, 200), (1, 1, 1000), (1, 5, 1000), (8, 1, 500), (16, 1, 200), (16, 5, 200)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    native_ops("on")
    torch.set_num_threads(args.threads)
    none = torch.empty(0)
    print(
        f"{'rows':>4} {'queries':>7} {'columns':>7}  {'vector us':>9} {'ns/head-col':>11} {'x30 ms':>7}  "
        f"{'portable us':>11}  {'ratio':>5}"
    )
    with torch.inference_mode():
        for rows, n, length in SHAPES:
            inputs = (
                torch.randn(rows, HEADS, n, DIM),
                torch.randn(rows, KV_HEADS, length, DIM),
                torch.randn(rows, KV_HEADS, length, DIM),
                torch.ones(rows, 1, n, length, dtype=torch.bool),
                none,
                DIM**-0.5,
            )
            fast, plain = (
                median_ms(lambda p=p, i=inputs: torch.ops.spec_batch.attend(*i, p), args.repeats) / 1e3
                for p in (False, True)
            )
            per_col = fast * 1e9 / (rows * HEADS * n * length)
            print(
                f"{rows:>4} {n:>7} {length:>7}  {fast * 1e6:>9.1f} {per_col:>11.2f} {fast * LAYERS * 1e3:>7.2f}  "
                f"{plain * 1e6:>11.1f}  {plain / fast:>4.2f}x"
            )


if __name__ == "__main__":
    main()
