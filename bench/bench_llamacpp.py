"""spec-batch at each precision against llama.cpp on the same GGUF file: llama-cpp-python, and llama.cpp's own tools.

Question: with the default model's own Q4_1 file, how fast is spec-batch at full fp32, full bf16, int8, int4 and
w4a8, plain and speculative at batch 1 and in a bulk job at batch 8, next to llama.cpp's plain decoding of the same
file at the same thread count -- and what do load time and resident memory cost? Optionally: how much does each
engine lose beside other CPU-heavy processes (issue 37, "robust to a busy machine")?

    flock /tmp/specbatch-cpu.lock .venv/bin/python -m bench.bench_llamacpp [--rounds 2] [--threads 2]
        [--set edits] [--n 8] [--max-tokens 96] [--configs full-fp32,full-bf16,int8,int4,int4-bf16,w4a8,llamacpp]
        [--self-draft] [--llama-bin DIR] [--forwards own,hf] [--burner N]

Every spec-batch configuration runs in a fresh process (its load time and resident memory are its own), one after
another within a round, the rounds interleaved; greedy. tokens_per_s is output tokens over the whole generate call
(prefill included); decode_tok_s excludes the prefill: prefill_s is the wall time of a 1-token generation of the
same prompts at the same batch size (the prompts' prefill and the first token's step; RequestStats carries no
prefill time), and decode_tok_s = (output tokens - one a prompt) / (wall - prefill_s). Each spec-batch run of the
set is one job (a job memory, as `spec-batch run` keeps); `--set templated` is a bulk templated job, whose outputs
share text with each other.

--llama-bin DIR (`../shared/tools/build-llama-bench.sh` builds the tools and prints DIR) also runs, in each round,
`llama-bench -p 0 -n MAX_TOKENS -r 1` (plain decoding from an empty context) and `llama-batched-bench -npp NPP
-ntg MAX_TOKENS -npl 1,8` (NPP: the set's mean prompt tokens under the chat template, or --npp) on the same file at
--threads; their S_TG is decode_tok_s, S_PP prefill_tok_s. The comparison table sets spec-batch's decode tokens/s
at batch 1 against llama-bench and at batch 8 (aggregate) against llama-batched-bench's 8 sequences.
--forwards own,hf runs each spec-batch configuration once per forward (SPEC_BATCH_FORWARD in the child).
--burner N measures every configuration twice a round, quiet and beside N busy-loop processes (started before the
measurement's process, killed after it), and prints busy/quiet per engine.
llama-cpp-python is an optional extra (`pip install -e .[llamacpp]`, docs/weights.md); without it its rows fail
with an error line and are left out. Prints one JSON line per (round, configuration, mode, load) and median tables
at the end.
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

from bench import llama_tools
from bench.burner import burners
from bench.precisions import PRECISIONS
from bench.prompts import SETS

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("llama-bench", "llama-batched-bench")  # run with --llama-bin, in this process


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
    from spec_batch.loading.llama_forward import forward_kind

    torch.set_num_threads(args.threads)
    weights, dtype = PRECISIONS[config]
    t0 = time.perf_counter()
    plain = load_decoder("default", "none", dtype=dtype, weights=weights)
    load_s = time.perf_counter() - t0
    spec = load_decoder("default", args.draft, dtype=dtype, weights=weights)
    modes = [
        ("plain b1", plain, 1),
        ("plain b8", plain, 8),
        (f"{args.draft} b1", spec, 1),
        (f"{args.draft} b8", spec, 8),
    ]
    if args.self_draft:  # the target's own file at int4 as its draft (gpt-fast's pairing), beside args.draft
        modes.append(("self:int4 b1", load_decoder("default", "self:int4", dtype=dtype, weights=weights), 1))
    prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in _prompts(args.set, args.n)]
    prompt_tokens = sum(len(p) for p in prompts)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    base = {
        "config": config + (f"/{args.forward}" if args.forward else ""),
        "forward": forward_kind(plain.target),
        "load_s": round(load_s, 2),
        "rss_mb": round(_rss_mb(), 1),
        "weights_mb": round(_weight_mb(plain.target), 1),
        "prompt_tokens": round(prompt_tokens / len(prompts), 1),  # mean a prompt
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
        # the prefill, measured apart (after the timed run, with its own memory: the timed run is as before)
        t = time.perf_counter()
        dec.generate(prompts, SamplingParams(max_new_tokens=1), batch_size=batch, memory=JobMemory())
        prefill = time.perf_counter() - t
        decode = wall - prefill
        rows.append(
            {
                **base,
                "mode": mode,
                "tokens": tokens,
                "wall_s": round(wall, 2),
                "tokens_per_s": round(tokens / wall, 1),
                "decode_tok_s": round((tokens - len(prompts)) / decode, 1) if decode > 0 else None,
                "prefill_s": round(prefill, 3),
                "prefill_tok_s": round(prompt_tokens / prefill, 1),
                "token_ids": [r.token_ids for r in results],
            }
        )
    return rows


def mean_prompt_tokens(args) -> None:
    """The set's mean prompt tokens under the default model's chat template (llama-batched-bench's -npp)."""
    from spec_batch.loading import load_decoder

    dec = load_decoder("default", "none")
    prompts = [dec.apply_chat_template([{"role": "user", "content": p}]) for p in _prompts(args.set, args.n)]
    print(json.dumps({"prompt_tokens": sum(map(len, prompts)) / len(prompts)}))


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


def _child(config: str, args, forward: str | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "bench.bench_llamacpp", "--child", config, "--threads", str(args.threads)]
    cmd += ["--set", args.set, "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--draft", args.draft]
    cmd += ["--self-draft"] if args.self_draft else []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if forward:  # settings.py reads it in the child, when the model loads
        cmd += ["--forward", forward]
        env["SPEC_BATCH_FORWARD"] = forward
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    label = config + (f"/{forward}" if forward else "")
    if proc.returncode != 0:
        return [{"config": label, "error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _tool(name: str, args, npp: int) -> list[dict]:
    """One run of a llama.cpp tool on the default model's file; an error row when it fails."""
    from spec_batch.loading.resolve import default_gguf_path

    bin_dir, model = Path(args.llama_bin), default_gguf_path()
    if name == "llama-bench":
        cmd = llama_tools.llama_bench_cmd(bin_dir, model, args.max_tokens, args.threads)
        parse = llama_tools.parse_llama_bench
    else:
        cmd = llama_tools.batched_bench_cmd(bin_dir, model, npp, args.max_tokens, args.threads)
        parse = llama_tools.parse_batched_bench
    try:
        return parse(llama_tools.run_tool(cmd, bin_dir))
    except (OSError, subprocess.CalledProcessError, ValueError, KeyError) as e:
        return [{"config": name, "error": [str(getattr(e, "stderr", None) or e)]}]


def _npp(args) -> int:
    """-npp for llama-batched-bench: --npp, or the set's mean prompt tokens measured in a child process."""
    if args.npp:
        return args.npp
    cmd = [sys.executable, "-m", "bench.bench_llamacpp", "--child", "prompt-tokens", "--set", args.set]
    proc = subprocess.run(cmd + ["--n", str(args.n)], capture_output=True, text=True, cwd=REPO, check=True)
    return round(json.loads(proc.stdout.strip().splitlines()[-1])["prompt_tokens"])


def _plan(args) -> list[tuple[str, str | None]]:
    """(configuration, forward) in a round's order: each spec-batch precision once per --forwards, then the tools."""
    forwards = args.forwards.split(",") if args.forwards else [None]
    configs = [c for c in args.configs.split(",") if c]  # --configs '' with --llama-bin: the tools alone
    plan = [(c, f) for c in configs for f in (forwards if c in PRECISIONS else [None])]
    return plan + ([(t, None) for t in TOOLS] if args.llama_bin else [])


def _fmt(x: float | None, width: int = 7, digits: int = 1, unit: str = "") -> str:
    return f"{x:{width}.{digits}f}{unit}" if x is not None else f"{'-':>{width + len(unit)}s}"


def _median(rows: list[dict], key: str) -> float | None:
    values = [x[key] for x in rows if x.get(key) is not None]
    return statistics.median(values) if values else None


def compare(results: dict[tuple[str, str, str], list[dict]], load: str) -> list[tuple[str, dict]]:
    """Decode-only tokens/s of each spec-batch (configuration, engine) at batch 1 and 8, each with its ratio to
    llama-bench (batch 1) and to llama-batched-bench's 8 sequences (batch 8), medians over the rounds."""
    med = {(c, m): _median(rows, "decode_tok_s") for (c, m, ld), rows in results.items() if ld == load}
    e2e = {(c, m): _median(rows, "tokens_per_s") for (c, m, ld), rows in results.items() if ld == load}
    plain, batched = med.get(("llama-bench", "plain b1")), med.get(("llama-batched-bench", "plain b8"))
    out = []
    for config, mode in med:
        if config in TOOLS or config == "llamacpp" or not mode.endswith(" b1"):
            continue
        engine = mode[: -len(" b1")]
        b1, b8 = med[(config, mode)], med.get((config, f"{engine} b8"))
        row = {"b1": b1, "b1_e2e": e2e[(config, mode)], "b8": b8, "b8_e2e": e2e.get((config, f"{engine} b8"))}
        row["vs_plain"] = b1 / plain if b1 and plain else None
        row["vs_batched"] = b8 / batched if b8 and batched else None
        out.append((f"{config} {engine}", row))
    return out


def _print_tables(results: dict[tuple[str, str, str], list[dict]], args, loads: list[str]) -> None:
    print(
        f"\nmedians over {args.rounds} round(s), {args.threads} thread(s), set {args.set!r} x {args.n}, "
        f"{args.max_tokens} tokens, greedy (tok/s: end to end; decode: prefill excluded):"
    )
    print(
        f"{'config':22s} {'mode':12s} {'load':5s} {'tok/s':>7s} {'decode':>7s} {'pre s':>7s} {'pre t/s':>7s} "
        f"{'load s':>7s} {'RSS MB':>7s} {'weights MB':>10s}"
    )
    for (config, mode, load), rows in results.items():
        print(
            f"{config:22s} {mode:12s} {load:5s} {_fmt(_median(rows, 'tokens_per_s'))} "
            f"{_fmt(_median(rows, 'decode_tok_s'))} {_fmt(_median(rows, 'prefill_s'), 7, 3)} "
            f"{_fmt(_median(rows, 'prefill_tok_s'))} {_fmt(_median(rows, 'load_s'))} "
            f"{_fmt(_median(rows, 'rss_mb'), 7, 0)} {_fmt(_median(rows, 'weights_mb'), 10)}"
        )
    if args.llama_bin:
        for load in loads:
            print(
                f"\ndecode tok/s against llama.cpp's tools ({load}): batch 1 vs llama-bench -p 0, batch 8 (aggregate) "
                "vs llama-batched-bench at 8 sequences; end to end in brackets"
            )
            print(f"{'engine':30s} {'batch 1':>17s} {'vs plain':>9s} {'batch 8':>17s} {'vs 8 seq':>9s}")
            for engine, row in compare(results, load):
                print(
                    f"{engine:30s} {_fmt(row['b1'])} ({_fmt(row['b1_e2e'])}) {_fmt(row['vs_plain'], 8, 2, 'x')} "
                    f"{_fmt(row['b8'])} ({_fmt(row['b8_e2e'])}) {_fmt(row['vs_batched'], 8, 2, 'x')}"
                )
    if "busy" in loads:
        print(f"\nunder load ({args.burner} burner process(es)): decode tok/s (end to end where no decode figure)")
        print(f"{'config':22s} {'mode':12s} {'quiet':>7s} {'busy':>7s} {'busy/quiet':>10s}")
        for (config, mode, load), rows in results.items():
            busy = results.get((config, mode, "busy"))
            if load != "quiet" or not busy:
                continue
            key = "decode_tok_s" if _median(rows, "decode_tok_s") is not None else "tokens_per_s"
            q, b = _median(rows, key), _median(busy, key)
            ratio = b / q if q and b else None
            print(f"{config:22s} {mode:12s} {_fmt(q)} {_fmt(b)} {_fmt(ratio, 10, 2)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", default="edits")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", default="suffix")
    parser.add_argument("--configs", default="full-fp32,full-bf16,int8,int4,int4-bf16,w4a8,llamacpp")
    parser.add_argument("--self-draft", action="store_true", help="also time --draft self:int4 at batch 1")
    parser.add_argument("--llama-bin", default=None, help="folder of llama-bench and llama-batched-bench: run them too")
    parser.add_argument("--npp", type=int, default=0, help="llama-batched-bench -npp (default: the set's mean)")
    parser.add_argument("--forwards", default=None, help="e.g. own,hf: each spec-batch config under each forward")
    parser.add_argument("--burner", type=int, default=0, help="also measure beside N CPU-burner processes")
    parser.add_argument("--forward", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "prompt-tokens":
        mean_prompt_tokens(args)
        return
    if args.child:
        rows = run_llamacpp(args) if args.child == "llamacpp" else run_spec_batch(args.child, args)
        for row in rows:
            print(json.dumps(row))
        return
    npp = _npp(args) if args.llama_bin else 0
    loads = ["quiet", "busy"] if args.burner else ["quiet"]
    results: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(args.rounds):
        for config, forward in _plan(args):
            for load in loads:  # quiet and busy side by side, in the same round
                with burners(args.burner if load == "busy" else 0):
                    rows = _tool(config, args, npp) if config in TOOLS else _child(config, args, forward)
                for row in rows:
                    shown = {k: v for k, v in row.items() if k != "token_ids"}
                    print(json.dumps({"round": r, "load": load, **shown}), flush=True)
                    if "error" not in row:
                        results.setdefault((row["config"], row["mode"], load), []).append(row)
    _print_tables(results, args, loads)


if __name__ == "__main__":
    main()
