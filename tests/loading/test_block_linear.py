"""The W4A8 and W8A8 kernels (loading/kernels/block_linear.cpp): they compute the blocks' own weights, a row's
outputs are the same bits at every row count and beside any other rows, the SIMD paths (VNNI or AVX2, whichever this
CPU runs; AVX2 also when built without AVX-512, the attention's too) and the portable one agree bit for bit, and
layers concatenate (fused q/k/v, gate/up) without changing a bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from spec_batch.loading.block_linear import BlockLinear, Q8BlockLinear
from spec_batch.loading.kernels import native_ops, tuning
from spec_batch.loading.kernels.tuning import (
    AMX_ROWS,
    DISTANCES,
    KINDS,
    NEVER,
    ROWS,
    last_level_cache_bytes,
    tune_amx,
    tune_prefetch,
    tune_tile_pairs,
    tuned,
)

pytestmark = pytest.mark.skipif(not native_ops(), reason="no C++ compiler: the native kernels cannot be built here")


def _layer(out_features: int, in_features: int, seed: int = 0, kind: type = BlockLinear) -> BlockLinear:
    gen = torch.Generator().manual_seed(seed)
    return kind.quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, None, torch.float32)


def _portable(layer, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, Q8BlockLinear):
        return torch.ops.spec_batch.w8a8_linear(x, layer.packed, layer.scales, True)
    return torch.ops.spec_batch.w4a8_linear(x, layer.packed, layer.scales, layer.minimums, True)


def _path_rows(read, write, rows: int, missing: str):
    """Sets a kernel path's row threshold for both kinds (skips where the build lacks the path), restores after."""
    before = {kind: read(kind) for kind in KINDS}
    if before["w4a8"] < 0 and rows != NEVER:
        pytest.skip(missing)
    for kind in KINDS:
        if before[kind] > 0:
            write(kind, rows)
    yield rows
    for kind, kept in before.items():
        if kept > 0:
            write(kind, kept)


@pytest.fixture(params=[1, 4, NEVER], ids=["tile-pairs", "pairs-from-4-rows", "single-tiles"])
def tile_pair_rows(request):
    """Each of the AVX-512 paths (two tiles a 512-bit register from this many rows on, one tile a 256-bit one below),
    whichever tuning chose for this CPU; restored after."""
    ops = torch.ops.spec_batch
    missing = "this build has no tile pairs (no AVX-512 VNNI)"
    yield from _path_rows(ops.tile_pair_rows, ops.set_tile_pair_rows, request.param, missing)


@pytest.fixture(params=[16, NEVER], ids=["tile-multiplies", "no-tile-multiplies"])
def amx_rows(request):
    """AMX's tile multiplies for the chunks of 16 rows of calls of 16 rows or more, or none; restored after."""
    ops = torch.ops.spec_batch
    yield from _path_rows(ops.amx_rows, ops.set_amx_rows, request.param, "no AMX in this build or process")


@pytest.mark.parametrize("kind", [BlockLinear, Q8BlockLinear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 576), (200, 96), (64, 1536)])
def test_a_row_is_the_same_bits_at_every_row_count_and_on_both_paths(kind, dtype, shape, tile_pair_rows, amx_rows):
    layer = _layer(*shape, kind=kind)
    x = torch.randn(37, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    every = layer(x)
    assert every.dtype == dtype and every.shape == (37, shape[0])
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 32):  # a chunk's rows, and the rest run as one chunk
        assert torch.equal(layer(x[:n]), every[:n]), n
    assert torch.equal(layer(x[20:21]), every[20:21])
    assert torch.equal(_portable(layer, x)[:, : shape[0]].to(dtype), every)


def _paths() -> dict[str, dict]:
    ops = torch.ops.spec_batch
    return {
        "prefetch": {kind: ops.prefetch(kind) for kind in KINDS},
        "tile_pairs": {kind: ops.tile_pair_rows(kind) for kind in KINDS},
        "amx": {kind: ops.amx_rows(kind) for kind in KINDS},
    }


def _restore(before: dict[str, dict]) -> None:
    ops = torch.ops.spec_batch
    for kind, distance in before["prefetch"].items():
        ops.set_prefetch(kind, distance)
    for path, set_rows in (("tile_pairs", ops.set_tile_pair_rows), ("amx", ops.set_amx_rows)):
        for kind, rows in before[path].items():
            if rows > 0:
                set_rows(kind, rows)


@pytest.mark.parametrize("kind", [BlockLinear, Q8BlockLinear])
def test_the_prefetch_distance_changes_no_bit(kind):
    ops = torch.ops.spec_batch
    layer = _layer(576, 1536, kind=kind)
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(3))
    before = _paths()
    try:
        outputs = []
        for distance in DISTANCES:
            for name in KINDS:
                ops.set_prefetch(name, distance)
            outputs.append(layer(x))
        assert torch.equal(outputs[0], outputs[1])
    finally:
        _restore(before)


def test_tuning_chooses_a_timed_row_count_or_never_for_each_kind_and_the_kernels_follow_it():
    ops = torch.ops.spec_batch
    before = _paths()
    try:
        prefetch = tune_prefetch(trials=1, working_bytes=4 << 20)
        assert all(prefetch[k] in DISTANCES for k in KINDS)
        if before["tile_pairs"]["w4a8"] > 0:  # an AVX-512 build: the prefetches are real, and follow the choice
            assert all(ops.prefetch(k) == prefetch[k] for k in KINDS)
        pairs = tune_tile_pairs(trials=1, working_bytes=4 << 20)
        amx = tune_amx(trials=1, working_bytes=4 << 20)
        if before["tile_pairs"]["w4a8"] < 0:
            assert pairs is None and all(ops.tile_pair_rows(kind) == -1 for kind in KINDS)
        else:
            assert set(pairs) == set(KINDS)
            assert all(pairs[k] in (*ROWS, NEVER) and ops.tile_pair_rows(k) == pairs[k] for k in KINDS)
        if before["amx"]["w4a8"] < 0:
            assert amx is None and all(ops.amx_rows(kind) == -1 for kind in KINDS)
        else:
            assert all(amx[k] in (*AMX_ROWS, NEVER) and ops.amx_rows(k) == amx[k] for k in KINDS)
            assert _paths()["amx"] == amx  # timing the tile pairs left the tile multiplies as they were
    finally:
        _restore(before)
    with pytest.raises(RuntimeError, match="rows must be >= 1"):
        ops.set_tile_pair_rows("w4a8", 0)
    with pytest.raises(RuntimeError, match="rows must be >= 1"):
        ops.set_amx_rows("w8a8", 0)
    with pytest.raises(RuntimeError, match="kind must be w4a8 or w8a8"):
        ops.tile_pair_rows("int4")
    with pytest.raises(RuntimeError, match="kind must be w4a8 or w8a8"):
        ops.amx_rows("int4")
    with pytest.raises(RuntimeError, match="distance must be near or far"):
        ops.set_prefetch("w4a8", "farther")


def test_a_stored_choice_is_applied_and_a_broken_one_timed_again_and_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "NOISY_SPREAD", 100.0)  # stored however busy the tests leave the machine
    ops = torch.ops.spec_batch
    before = _paths()
    if before["tile_pairs"]["w4a8"] < 0:
        assert tuned(tmp_path / "spec_batch_ops-x.so") is None
        return
    library = tmp_path / "spec_batch_ops-x.so"
    stored = tmp_path / "spec_batch_ops-x.tuning.json"
    has_amx = before["amx"]["w4a8"] > 0
    choice = {
        "prefetch": {"w4a8": "far", "w8a8": "near"},
        "tile_pairs": {"w4a8": 3, "w8a8": 5},
        "amx": {"w4a8": 32, "w8a8": 16} if has_amx else None,
    }
    try:
        stored.write_text(json.dumps(choice))
        assert tuned(library) == choice
        assert (ops.tile_pair_rows("w4a8"), ops.tile_pair_rows("w8a8")) == (3, 5)
        assert (ops.prefetch("w4a8"), ops.prefetch("w8a8")) == ("far", "near")
        if has_amx:
            assert (ops.amx_rows("w4a8"), ops.amx_rows("w8a8")) == (32, 16)
        earlier = [json.dumps({"w4a8": 3, "w8a8": 5}), json.dumps({k: v for k, v in choice.items() if k != "prefetch"})]
        bad = [json.dumps({**choice, "amx": {"w4a8": 0}}), json.dumps({**choice, "prefetch": {"w4a8": 8, "w8a8": 8}})]
        for broken in ('{"w4a8": 0}', *earlier, *bad):  # not a choice, one stored by an earlier version, bad values
            stored.write_text(broken)
            chosen = tuned(library)
            assert set(chosen) == {"prefetch", "tile_pairs", "amx"}
            assert all(distance in DISTANCES for distance in chosen["prefetch"].values())
            assert all(rows in (*ROWS, NEVER) for rows in chosen["tile_pairs"].values())
            assert (chosen["amx"] is None) == (not has_amx)
            assert json.loads(stored.read_text()) == chosen
    finally:
        _restore(before)


def test_the_last_level_cache_is_read_from_sysfs_or_defaulted():
    size = last_level_cache_bytes(default=7)
    assert size == 7 or size >= 1 << 20


@pytest.mark.parametrize("kind", [BlockLinear, Q8BlockLinear])
def test_it_computes_the_blocks_weights_up_to_the_activations_int8_rounding(kind):
    layer = _layer(576, 1536, kind=kind)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(2))
    want = x @ layer.dequantized().t()
    assert (layer(x) - want).abs().max() < 0.02 * want.abs().max()


def test_q4_0_and_q4_1_blocks_are_taken_as_they_are():
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.uint8)
    d, m = torch.rand(16, 2, generator=gen).half(), -torch.rand(16, 2, generator=gen).half()
    blocks = q.float().view(16, 2, 32)
    q4_1 = BlockLinear.from_q4_1(q, d, m, None, torch.float32).dequantized()
    assert torch.equal(q4_1, (blocks * d.float()[..., None] + m.float()[..., None]).view(16, 64))
    q4_0 = BlockLinear.from_q4_0(q, d, None, torch.float32).dequantized()
    assert torch.equal(q4_0, ((blocks - 8) * d.float()[..., None]).view(16, 64))


def test_q8_0_blocks_are_taken_as_they_are_and_read_back_as_embedding_rows():
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (20, 64), generator=gen).to(torch.int8)
    d = torch.rand(20, 2, generator=gen).half()
    layer = Q8BlockLinear.from_q8_0(q, d, None, torch.float32)
    want = (q.float().view(20, 2, 32) * d.float()[..., None]).view(20, 64)
    assert torch.equal(layer.dequantized(), want)
    ids = torch.tensor([[19, 0, 7], [8, 8, 3]])
    assert torch.equal(layer.embedding_rows(ids), want[ids])
    with pytest.raises(RuntimeError, match="id 24 is out of range"):
        layer.embedding_rows(torch.tensor([24]))


@pytest.mark.parametrize("kind", [BlockLinear, Q8BlockLinear])
def test_concatenated_layers_give_the_same_bits_as_each_layer(kind):
    parts = [_layer(576, 576, 4, kind), _layer(192, 576, 5, kind), _layer(192, 576, 6, kind)]
    fused = kind.concat(parts)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="multiples of 8"):
        kind.concat([_layer(12, 64, kind=kind), _layer(8, 64, kind=kind)])


_AVX2_CHECK = """
import torch
from spec_batch.loading.block_linear import BlockLinear, Q8BlockLinear
from spec_batch.loading.kernels import native_ops
assert native_ops("on")
gen = torch.Generator().manual_seed(9)
for kind in (BlockLinear, Q8BlockLinear):
    layer = kind.quantize(torch.randn(72, 96, generator=gen) * 0.05, None, torch.float32)
    x = torch.randn(13, 96, generator=gen) * 3
    fast = layer(x)
    assert all(torch.equal(layer(x[:n]), fast[:n]) for n in (1, 2, 3, 5, 6))
    if kind is Q8BlockLinear:
        portable = torch.ops.spec_batch.w8a8_linear(x, layer.packed, layer.scales, True)
    else:
        portable = torch.ops.spec_batch.w4a8_linear(x, layer.packed, layer.scales, layer.minimums, True)
    assert torch.equal(fast, portable), kind
# the attention's AVX2 path (cpu_attention.cpp) against its portable one, fp32 and bf16, a ragged head dim too
for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 128), (torch.float32, 72)):
    q = (torch.randn(2, 6, 5, dim, generator=gen) * 4).to(dtype)
    k, v = (torch.randn(2, 2, 70, dim, generator=gen).to(dtype) for _ in range(2))
    visible = torch.rand(2, 1, 5, 70, generator=gen) > 0.3
    visible[1, 0, :2] = False
    for bias in (torch.empty(0), torch.randn(2, 1, 5, 70, generator=gen) * 30):
        fast = torch.ops.spec_batch.attend(q, k, v, visible, bias, 0.3)
        assert torch.equal(fast, torch.ops.spec_batch.attend(q, k, v, visible, bias, 0.3, True)), (dtype, dim)
print("same bits")
"""


@pytest.mark.skipif("avx512f" not in Path("/proc/cpuinfo").read_text(), reason="the default build already is AVX2")
def test_the_avx2_paths_built_on_an_avx512_cpu_give_the_portable_bits(tmp_path):
    """The AVX2 paths (what a CPU without AVX-512 runs: the block kernels' and the attention's) in a library built
    with -mno-avx512f, in its own process."""
    env = dict(os.environ, SPEC_BATCH_KERNEL_FLAGS="-mno-avx512f", SPEC_BATCH_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "same bits" in done.stdout, done.stderr[-3000:]


def test_a_thread_other_than_the_main_one_gets_the_same_bits():
    """Off the main thread the kernels split their work on their own spinning threads (kernels/spin_pool.cpp), not
    OpenMP's: a row's outputs stay the same bits, the attention's too, also with calls from two threads at once."""
    layers = [_layer(576, 576, 10), _layer(3072, 576, 11, Q8BlockLinear)]
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(12))
    gen = torch.Generator().manual_seed(13)
    q, k, v = (
        torch.randn(1, 9, 8, 64, generator=gen),
        torch.randn(1, 3, 200, 64, generator=gen),
        torch.randn(1, 3, 200, 64, generator=gen),
    )
    visible = torch.ones(1, 1, 8, 200, dtype=torch.bool)

    def compute() -> list[torch.Tensor]:
        attended = torch.ops.spec_batch.attend(q, k, v, visible, torch.empty(0), 0.125)
        return [layer(x) for layer in layers] + [attended]

    want = compute()
    got: list[list[torch.Tensor]] = []
    threads = [threading.Thread(target=lambda: got.append(compute())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 2
    for outputs in got:
        assert all(torch.equal(a, b) for a, b in zip(outputs, want))


_PASSIVE_CHECK = """
import torch
from spec_batch.loading.block_linear import BlockLinear, Q8BlockLinear
from spec_batch.loading.kernels import native_ops
native_ops("on")
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(14)
layers = [BlockLinear.quantize(torch.randn(3072, 576, generator=gen) * 0.05, None, torch.float32),
          Q8BlockLinear.quantize(torch.randn(576, 576, generator=gen) * 0.05, None, torch.float32)]
x = torch.randn(9, 576, generator=gen)
torch.save([layer(x[:n]) for layer in layers for n in (1, 4, 9)], {path!r})
"""


def test_the_main_thread_on_the_kernels_own_threads_gets_the_same_bits(tmp_path):
    """With OMP_WAIT_POLICY=passive the main thread's regions run on the kernels' own threads, split into pieces
    claimed in turn, not OpenMP's team: the same bits as the team's, in processes of their own."""
    outputs = []
    for policy in ("active", "passive"):
        path = tmp_path / f"{policy}.pt"
        env = dict(os.environ, OMP_WAIT_POLICY=policy)
        check = _PASSIVE_CHECK.format(path=str(path))
        done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(torch.load(path))
    assert len(outputs[0]) == 6 and all(torch.equal(a, b) for a, b in zip(*outputs))


def test_a_choice_timed_on_a_busy_machine_is_used_but_not_stored(tmp_path, monkeypatch):
    before = _paths()
    if before["tile_pairs"]["w4a8"] < 0:
        return
    library = tmp_path / "spec_batch_ops-x.so"
    monkeypatch.setattr(tuning, "NOISY_SPREAD", 0.5)  # every timing's spread (median over best >= 1) reads as noise
    try:
        chosen = tuned(library)
        assert set(chosen) == {"prefetch", "tile_pairs", "amx"}
        assert not (tmp_path / "spec_batch_ops-x.tuning.json").exists()
        monkeypatch.setattr(tuning, "NOISY_SPREAD", 100.0)  # quiet: timed again, and stored
        assert tuned(library) is not None and (tmp_path / "spec_batch_ops-x.tuning.json").exists()
    finally:
        _restore(before)
