"""spec-batch at each precision against llama.cpp (llama-cpp-python) on the same GGUF file.

Question: with the default model's own Q4_1 file, how fast is spec-batch at full fp32, full bf16, int8 and int4,
plain and speculative at batch 1 and in a bulk job at batch 8, next to llama.cpp's plain decoding of the same
prompts one after another, at the same thread count -- and what do load time and resident memory cost?

    flock /tmp/specbatch-cpu.lock .venv/bin/python -m bench.bench_llamacpp [--rounds 2] [--threads 2]
        [--set edits] [--n 8] [--max-tokens 96] [--configs full-fp32,full-bf16,int8,int4,int4-bf16,llamacpp] [--self-draft]

Every configuration runs in a fresh process (its load time and resident memory are its own), one after
another within a round, the rounds interleaved; tokens/s is output tokens over decode wall time, greedy. Each
spec-batch run of the set is one job (a job memory, as `spec-batch run` keeps); `--set templated` is a bulk
templated job, whose outputs share text with each other.
llama-cpp-python is an optional extra (`pip install -e .[llamacpp]`, docs/weights.md); without it the llama.cpp
rows are skipped. Prints one JSON line per (round, configuration, mode) and a median table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.precisions import PRECISIONS
from bench.prompts import SETS

REPO = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _prompts(name: str, n: int) -> list[str]:
    return SETS[name][:n]


def _weight_mb(model) -> float:
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.packed for m in model.modules() if type(m).__name__ == "PackedLinear"]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def run_spec_batch(config: str, args) -> list[dict]:
    import torch

    from spec_batch import SamplingParams
    from spec_batch.core.drafting.job_memory import JobMemory
    from spec_batch.loading import load_decoder

    torch.set_num_threads(args.threads)
    weights, dtype = PRECISIONS[config]
    t0 = time.perf_counter()
    plain = load_decoder("default", "none", dtype=dtype, weights=weights)
    load_s = time.perf_counter() - t0
    spec = load_decoder("default", args.draft, dtype=dtype, weights=weights)
    modes = [("plain b1", plain, 1), (f"{args.draft} b1", spec, 1), (f"{args.draft} b8", spec, 8)]
    if args.self_draft:  # the target's own file at int4 as its draft (gpt-fast's pairing), beside args.draft
        modes.append(("self:int4 b1", load_decoder("default", "self:int4", dtype=dtype, weights=weights), 1))
    prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in _prompts(args.set, args.n)]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    base = {
        "config": config,
        "load_s": round(load_s, 2),
        "rss_mb": round(_rss_mb(), 1),
        "weights_mb": round(_weight_mb(plain.target), 1),
    }
    rows = []
    plain.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
    for mode, dec, batch in modes:
        t = time.perf_counter()
        # each run of the set is one job, as bench_core runs it: the suffix drafter also drafts from the job's
        # other outputs (its memory); plain decoding ignores it
        results = dec.generate(prompts, params, batch_size=batch, memory=JobMemory())
        wall = time.perf_counter() - t
        tokens = sum(len(r.token_ids) for r in results)
        rows.append(
            {
                **base,
                "mode": mode,
                "tokens": tokens,
                "wall_s": round(wall, 2),
                "tokens_per_s": round(tokens / wall, 1),
                "token_ids": [r.token_ids for r in results],
            }
        )
    return rows


def run_llamacpp(args) -> list[dict]:
    from llama_cpp import Llama

    from spec_batch.loading.resolve import default_gguf_path

    t0 = time.perf_counter()
    llm = Llama(str(default_gguf_path()), n_threads=args.threads, n_ctx=2048, verbose=False)
    load_s = time.perf_counter() - t0
    tokens = wall = 0.0
    for prompt in _prompts(args.set, args.n):
        t = time.perf_counter()
        out = llm.create_chat_completion(
            [{"role": "user", "content": prompt}], max_tokens=args.max_tokens, temperature=0.0, top_k=1
        )
        wall += time.perf_counter() - t
        tokens += out["usage"]["completion_tokens"]
    return [
        {
            "config": "llamacpp",
            "mode": "plain b1",
            "load_s": round(load_s, 2),
            "rss_mb": round(_rss_mb(), 1),
            "tokens": int(tokens),
            "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1),
        }
    ]


def _child(config: str, args) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_llamacpp",
        "--child",
        config,
        "--threads",
        str(args.threads),
        "--set",
        args.set,
        "--n",
        str(args.n),
        "--max-tokens",
        str(args.max_tokens),
        "--draft",
        args.draft,
    ]
    cmd += ["--self-draft"] if args.self_draft else []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        return [{"config": config, "error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", default="edits")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", default="suffix")
    parser.add_argument("--configs", default="full-fp32,full-bf16,int8,int4,int4-bf16,llamacpp")
    parser.add_argument("--self-draft", action="store_true", help="also time --draft self:int4 at batch 1")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rows = run_llamacpp(args) if args.child == "llamacpp" else run_spec_batch(args.child, args)
        for row in rows:
            print(json.dumps(row))
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for config in args.configs.split(","):
            for row in _child(config, args):
                print(json.dumps({"round": r, **{k: v for k, v in row.items() if k != "token_ids"}}), flush=True)
                if "error" not in row:
                    results.setdefault((row["config"], row["mode"]), []).append(row)
    print(
        f"\nmedians over {args.rounds} round(s), {args.threads} thread(s), set {args.set!r} x {args.n}, "
        f"{args.max_tokens} tokens, greedy:"
    )
    print(f"{'config':10s} {'mode':12s} {'tok/s':>7s} {'load s':>7s} {'RSS MB':>7s} {'weights MB':>10s}")
    for (config, mode), rows in results.items():
        med = lambda k, rows=rows: statistics.median(x[k] for x in rows)
        weights = f"{med('weights_mb'):10.1f}" if "weights_mb" in rows[0] else f"{'-':>10s}"
        print(f"{config:10s} {mode:12s} {med('tokens_per_s'):7.1f} {med('load_s'):7.1f} {med('rss_mb'):7.0f} {weights}")


if __name__ == "__main__":
    main()
