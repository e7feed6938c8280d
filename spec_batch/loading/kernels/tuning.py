"""Which of the kernels' equivalent paths runs faster on this CPU, timed once a machine as the library loads.

In a build with AVX-512 VNNI the block kernels (block_linear.cpp) can run two neighbouring output tiles in one
512-bit register. Where 512-bit operations run at full width (Intel Sapphire Rapids) that halves the instructions.
On AMD Zen 4 (512-bit operations issued as two 256-bit halves), with the weights streaming from memory as in a
decode step, the pairs lose at a few rows: on a 2-core Zen 4 VM, one row through 40 gate/up layers took 111 us a
layer with pairs and 75 without, the W8A8 head 2.0 ms against 0.9; with the weights in L2 the pairs won (48 against
50 us). No CPU flag tells the cases apart, so the kernels are timed, streaming from memory, once a machine: the choice is
stored beside the compiled library (`<cache>/kernels/spec_batch_ops-<key>.tuning.json`; delete it to time again), so
every process of the machine runs the same paths (timed in each process, near-ties fell either way, and two servers
compared side by side differed by what each had measured). Every path computes the same bits
(tests/loading/test_block_linear.py runs each), so the choice changes speed only.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed: a decode step's, a verify step's, a batch's, a prefill's
NEVER = 1 << 40  # a tile-pair threshold no call reaches
MARGIN = 1.05  # pairs must be this much faster to be chosen: near a tie, timing noise would pick by chance per process
KINDS = ("w4a8", "w8a8")
# what each kind runs in the default model: a layer's q/k/v, o, gate/up and down projections; the LM head
SHAPES = {"w4a8": ((960, 576), (576, 576), (3072, 576), (576, 1536)), "w8a8": ((49152, 576),)}
_BLOCK_BYTES = {"w4a8": 128 + 32, "w8a8": 256 + 16}  # a tile's block: weights, float16 scales (and minimums)


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache sysfs reports (the weights must stream from beyond it); `default` where none does."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


def _layers(kind: str, working_bytes: int) -> Callable[[int], Callable[[], None]]:
    """For a row count, one pass through enough copies of the kind's shapes (a layer's projections one after
    another) to stream `working_bytes` from memory, as a decode step does. The weights' values do not change the
    kernels' time (integer dot products), so they are constants."""
    ops = torch.ops.spec_batch
    per_copy = sum(o // 8 * (k // 32) * _BLOCK_BYTES[kind] for o, k in SHAPES[kind])
    copies = max(1, math.ceil(working_bytes / per_copy))
    tensors = []
    for out_features, in_features in SHAPES[kind]:
        tiles, blocks = out_features // 8, in_features // 32
        weight = torch.full((copies, tiles, blocks, 4 if kind == "w4a8" else 8, 8, 4), 0x5A, dtype=torch.uint8)
        d = torch.full((copies, tiles, blocks, 8), 0.01, dtype=torch.float16)
        tensors.append((in_features, weight, d, torch.full_like(d, -0.05)))

    def for_rows(rows: int) -> Callable[[], None]:
        inputs = [torch.full((rows, in_features), 0.5) for in_features, *_ in tensors]
        used = copies if rows <= 8 else max(1, copies * 8 // rows)  # many rows: bound by arithmetic, fewer copies do

        def run() -> None:
            for i in range(used):
                for x, (_, weight, d, m) in zip(inputs, tensors):
                    if kind == "w4a8":
                        ops.w4a8_linear(x, weight[i], d[i], m[i])
                    else:
                        ops.w8a8_linear(x, weight[i], d[i])

        return run

    return for_rows


def tune_tile_pairs(trials: int = 3, working_bytes: int | None = None) -> dict[str, int] | None:
    """For each kind, times passes through layers streaming `working_bytes` (1.5x the last-level cache by default)
    with and without tile pairs at each of ROWS, alternating, each one's best of `trials`; sets the row count from
    which the kind's calls run pairs to the smallest from which pairs win (by MARGIN) at every larger count timed
    (NEVER where they never win) and returns the choices. None: this build has no tile pairs. ~0.4 s on 2 cores."""
    ops = torch.ops.spec_batch
    if ops.tile_pair_rows("w4a8") < 0:
        return None
    working = working_bytes or min(192 << 20, max(32 << 20, last_level_cache_bytes() * 3 // 2))
    chosen = {}
    for kind in KINDS:
        passes = _layers(kind, working)
        wins = {}
        for rows in ROWS:
            run = passes(rows)
            best = {1: math.inf, NEVER: math.inf}
            for _ in range(trials):
                for threshold in best:
                    ops.set_tile_pair_rows(kind, threshold)
                    started = time.perf_counter()
                    run()
                    best[threshold] = min(best[threshold], time.perf_counter() - started)
            wins[rows] = best[1] * MARGIN < best[NEVER]
        chosen[kind] = NEVER
        for rows in reversed(ROWS):
            if not wins[rows]:
                break
            chosen[kind] = rows
        ops.set_tile_pair_rows(kind, chosen[kind])
    return chosen


def tuned(library: Path) -> dict[str, int] | None:
    """Applies this machine's tile-pair choices for `library`: those stored beside it, else timed now
    (tune_tile_pairs) and stored, under a lock so that processes starting together time once. None: no tile pairs."""
    ops = torch.ops.spec_batch
    if ops.tile_pair_rows("w4a8") < 0:
        return None
    stored = library.with_name(library.stem + ".tuning.json")
    with open(library.parent / ".tuning.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        chosen = _read(stored)
        if chosen is not None:
            for kind, rows in chosen.items():
                ops.set_tile_pair_rows(kind, rows)
            return chosen
        chosen = tune_tile_pairs(trials=5)
        partial = stored.with_name(stored.name + f".{os.getpid()}")
        partial.write_text(json.dumps(chosen))
        os.replace(partial, stored)  # whole or not at all
        return chosen


def _read(stored: Path) -> dict[str, int] | None:
    """A stored choice, or None where there is none or it is not one (then it is timed again)."""
    try:
        chosen = json.loads(stored.read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(chosen, dict) and set(chosen) == set(KINDS)
    if not valid or not all(isinstance(rows, int) and rows >= 1 for rows in chosen.values()):
        return None
    return chosen
