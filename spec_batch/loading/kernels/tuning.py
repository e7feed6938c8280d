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

Where the build and the process have AMX (Intel's tile multiply: Sapphire Rapids on), a call's tile pairs can also
run their chunks of 16 rows by tile multiplies: timed the same way, after the tile pairs, from 16 rows on. Before
both, how far ahead the kernels ask for weights (8 blocks into L1, or 4 KB into L2), timed at one row.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..huge_pages import huge_page_buffer

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed: a decode step's, a verify step's, a batch's, a prefill's
AMX_ROWS = (16, 32, 64)  # tile multiplies take 16 rows at a time
NEVER = 1 << 40  # a threshold no call reaches
MARGIN = 1.05  # a path must be this much faster to be chosen: near a tie, timing noise would pick by chance per process
KINDS = ("w4a8", "w8a8")
# A timing's median over its best beyond this is noise; where over a quarter of them are, the machine was busy (a
# choice timed beside a compiler build once ran no tile pairs, its prefill 1.36x slower) and nothing is stored.
NOISY_SPREAD = 1.15
PATHS = ("prefetch", "tile_pairs", "amx")  # the stored choice: {path: {kind: "near" | "far", or a row count}}
DISTANCES = ("near", "far")  # how far ahead the kernels ask for weights (block_linear.cpp's fetch_ahead)
# "near" must win by this much, else "far": on a 2-core Xeon VM, plain decoding at batch 1 ran 1.11x faster with far
# for both kinds than with near, 1.065x with far for W4A8 alone; timed apart (one kind's calls back to back), far
# won for W4A8 and tied for the head, so the kinds are timed as a step runs them, layers then the head
PREFETCH_MARGIN = 1.02
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


def _constants(nbytes: int) -> Callable[[tuple[int, ...], torch.dtype, float], torch.Tensor]:
    """A maker of constant tensors, in one buffer on huge pages where the machine has them (as a loaded model's
    weights are: loading/huge_pages.py), else torch's own."""
    arena = huge_page_buffer(nbytes + 64 * 16)  # room for each tensor's round-up to a cache line
    used = 0

    def constant(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> torch.Tensor:
        nonlocal used
        if arena is None:
            return torch.full(shape, value, dtype=dtype)
        size = math.prod(shape) * dtype.itemsize
        tensor = arena[used : used + size].view(dtype).view(shape)
        used += -(-size // 64) * 64
        return tensor.fill_(value)

    return constant


def _layers(kind: str, working_bytes: int) -> Callable[[int], Callable[[], None]]:
    """For a row count, one pass through enough copies of the kind's shapes (a layer's projections one after
    another) to stream `working_bytes` from memory, as a decode step does. The weights' values do not change the
    kernels' time (integer dot products), so they are constants."""
    ops = torch.ops.spec_batch
    per_copy = sum(o // 8 * (k // 32) * _BLOCK_BYTES[kind] for o, k in SHAPES[kind])
    copies = max(1, math.ceil(working_bytes / per_copy))
    constant = _constants(copies * per_copy)
    tensors = []
    for out_features, in_features in SHAPES[kind]:
        tiles, blocks = out_features // 8, in_features // 32
        weight = constant((copies, tiles, blocks, 4 if kind == "w4a8" else 8, 8, 4), torch.uint8, 0x5A)
        d = constant((copies, tiles, blocks, 8), torch.float16, 0.01)
        m = constant((copies, tiles, blocks, 8), torch.float16, -0.05) if kind == "w4a8" else d  # (W8A8 has none)
        tensors.append((in_features, weight, d, m))

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


_spreads: list[float] = []  # each timed candidate's median over its best, since tune() began


def _best_of(trials: int, candidates: tuple, use: Callable[[Any], None], run: Callable[[], object]) -> dict:
    """Each candidate's best time of `trials` passes of `run`, the candidates alternating (`use` switches to one);
    each one's spread (median over best) is kept for tuned() to judge the machine's quiet."""
    samples: dict = {candidate: [] for candidate in candidates}
    for _ in range(trials):
        for candidate in candidates:
            use(candidate)
            started = time.perf_counter()
            run()
            samples[candidate].append(time.perf_counter() - started)
    _spreads.extend(statistics.median(times) / min(times) for times in samples.values())
    return {candidate: min(times) for candidate, times in samples.items()}


def _rows_from(kind: str, path: str, rows_timed: tuple[int, ...], trials: int, working: int) -> int:
    """Times passes through the kind's layers with `path` on and off at each of `rows_timed`, alternating, each
    one's best of `trials`; sets and returns the smallest count from which the path wins (by MARGIN) at every
    larger count timed, NEVER where it never wins."""
    ops = torch.ops.spec_batch
    set_rows = ops.set_tile_pair_rows if path == "tile_pairs" else ops.set_amx_rows
    passes = _layers(kind, working)
    wins = {}
    for rows in rows_timed:
        best = _best_of(trials, (1, NEVER), lambda threshold: set_rows(kind, threshold), passes(rows))
        wins[rows] = best[1] * MARGIN < best[NEVER]
    chosen = NEVER
    for rows in reversed(rows_timed):
        if not wins[rows]:
            break
        chosen = rows
    set_rows(kind, chosen)
    return chosen


def _working(working_bytes: int | None) -> int:
    return working_bytes or min(192 << 20, max(32 << 20, last_level_cache_bytes() * 3 // 2))


def tune_tile_pairs(trials: int = 3, working_bytes: int | None = None) -> dict[str, int] | None:
    """For each kind, the row count from which its calls run tile pairs (_rows_from over ROWS, streaming
    `working_bytes`: 1.5x the last-level cache by default), with tile multiplies off while timed; sets and returns
    the choices. None: this build has no tile pairs. ~0.4 s on 2 cores."""
    ops = torch.ops.spec_batch
    if ops.tile_pair_rows("w4a8") < 0:
        return None
    amx = {kind: ops.amx_rows(kind) for kind in KINDS}
    chosen = {}
    for kind in KINDS:
        if amx[kind] > 0:
            ops.set_amx_rows(kind, NEVER)
        try:
            chosen[kind] = _rows_from(kind, "tile_pairs", ROWS, trials, _working(working_bytes))
        finally:
            if amx[kind] > 0:
                ops.set_amx_rows(kind, amx[kind])
    return chosen


def tune_amx(trials: int = 3, working_bytes: int | None = None) -> dict[str, int] | None:
    """For each kind, the row count from which its calls run tile multiplies (_rows_from over AMX_ROWS, the tile
    pairs as set); sets and returns the choices. None: this build or process has no AMX."""
    ops = torch.ops.spec_batch
    if ops.amx_rows("w4a8") < 0:
        return None
    return {kind: _rows_from(kind, "amx", AMX_ROWS, trials, _working(working_bytes)) for kind in KINDS}


def tune_prefetch(trials: int = 3, working_bytes: int | None = None) -> dict[str, str]:
    """For each kind, how far ahead its calls ask for weights, timed as a decode step streams them: one-row passes
    through W4A8 layers and then W8A8 heads (2:1, `working_bytes` in all), with the kind's DISTANCES in turn (the
    kinds before it as chosen, those after it "far"), alternating, each one's best of `trials`; "near" where it wins
    by PREFETCH_MARGIN, else "far". Sets and returns them."""
    ops = torch.ops.spec_batch
    working = _working(working_bytes)
    layers, heads = _layers("w4a8", working * 2 // 3)(1), _layers("w8a8", working // 3)(1)
    chosen = dict.fromkeys(KINDS, "far")
    for kind in KINDS:
        for other in KINDS:
            ops.set_prefetch(other, chosen[other])

        def use(distance: str, kind: str = kind) -> None:
            ops.set_prefetch(kind, distance)

        best = _best_of(trials, DISTANCES, use, lambda: (layers(), heads()))
        chosen[kind] = "near" if best["near"] * PREFETCH_MARGIN < best["far"] else "far"
    for kind in KINDS:
        ops.set_prefetch(kind, chosen[kind])
    return chosen


Choice = dict[str, dict[str, int] | dict[str, str] | None]


def tune(trials: int = 3) -> Choice:
    """Every path's choices, {path: {kind: choice}} (None for a path this build or process lacks), set as timed:
    the prefetch distance first (the other paths' timings stream weights too). For builds with tile pairs
    (tuned())."""
    _spreads.clear()
    prefetch = tune_prefetch(trials)
    return {"prefetch": prefetch, "tile_pairs": tune_tile_pairs(trials), "amx": tune_amx(trials)}


def _apply(chosen: Choice) -> None:
    ops = torch.ops.spec_batch
    setters = (("prefetch", ops.set_prefetch), ("tile_pairs", ops.set_tile_pair_rows), ("amx", ops.set_amx_rows))
    for path, set_choice in setters:
        for kind, value in (chosen[path] or {}).items():
            set_choice(kind, value)


def tuned(library: Path) -> Choice | None:
    """Applies this machine's path choices for `library`: those stored beside it, else timed now (tune) and stored,
    under a lock so that processes starting together time once. None: this build has no tile pairs (an AVX2 or
    portable build: no AMX either, and its prefetch stays "near")."""
    ops = torch.ops.spec_batch
    if ops.tile_pair_rows("w4a8") < 0:
        return None
    stored = library.with_name(library.stem + ".tuning.json")
    with open(library.parent / ".tuning.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        chosen = _read(stored)
        if chosen is not None and (chosen["amx"] is None) == (ops.amx_rows("w4a8") < 0):
            _apply(chosen)
            return chosen
        chosen = tune(trials=5)
        noisy = sum(spread > NOISY_SPREAD for spread in _spreads)
        if noisy > len(_spreads) // 4:  # a busy machine: use the choice here, time again in a later process
            log.warning(
                "kernel path timings were noisy (%d of %d over %.2f): not stored", noisy, len(_spreads), NOISY_SPREAD
            )
            return chosen
        partial = stored.with_name(stored.name + f".{os.getpid()}")
        partial.write_text(json.dumps(chosen))
        os.replace(partial, stored)  # whole or not at all
        return chosen


def _read(stored: Path) -> Choice | None:
    """A stored choice, or None where there is none or it is not one (then it is timed again)."""
    try:
        chosen = json.loads(stored.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(chosen, dict) or set(chosen) != set(PATHS):
        return None
    if chosen["prefetch"] is None or chosen["tile_pairs"] is None:
        return None
    for path, by_kind in chosen.items():
        if by_kind is None:
            continue
        if not isinstance(by_kind, dict) or set(by_kind) != set(KINDS):
            return None
        valid = (lambda v: v in DISTANCES) if path == "prefetch" else (lambda v: isinstance(v, int) and v >= 1)
        if not all(valid(value) for value in by_kind.values()):
            return None
    return chosen
