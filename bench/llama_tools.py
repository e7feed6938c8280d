"""llama.cpp's own benchmark tools (llama-bench, llama-batched-bench) run on a GGUF file, their output parsed into
bench_llamacpp's rows. Build the tools with `../shared/tools/build-llama-bench.sh` (it prints their folder).

Row fields: decode_tok_s (generated tokens over decode time, prefill excluded: llama.cpp's own S_TG / avg_ts),
prefill_tok_s and prefill_s (prompt processing, S_PP / T_PP), tokens_per_s (generated tokens over prefill + decode:
comparable with spec-batch's end-to-end figure)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

BATCHED_NPL = (1, 8)  # llama-batched-bench's parallel sequences: the plain figure and the bulk batch


def llama_bench_cmd(bin_dir: Path, model: Path, max_tokens: int, threads: int) -> list[str]:
    """Plain decoding from an empty context (-p 0), one repetition: one round's measurement."""
    exe = str(bin_dir / "llama-bench")
    return [exe, "-m", str(model), "-p", "0", "-n", str(max_tokens), "-t", str(threads), "-r", "1", "-o", "json"]


def batched_bench_ctx(npp: int, max_tokens: int) -> int:
    """A context that holds every sequence's prompt and output (the tool needs pl * (pp + tg) cells)."""
    return max(2048, max(BATCHED_NPL) * (npp + max_tokens))


def batched_bench_cmd(bin_dir: Path, model: Path, npp: int, max_tokens: int, threads: int) -> list[str]:
    """Sequences decoding together after a prompt of npp tokens each, at 1 and 8 sequences."""
    ctx = batched_bench_ctx(npp, max_tokens)
    exe, npl = str(bin_dir / "llama-batched-bench"), ",".join(map(str, BATCHED_NPL))
    cmd = [exe, "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(max_tokens)]
    return cmd + ["-npl", npl, "-t", str(threads), "--output-format", "jsonl"]


def run_tool(cmd: list[str], bin_dir: Path) -> str:
    """The tool's stdout; its shared libraries sit beside it. Raises CalledProcessError with its stderr's tail."""
    lib = os.environ.get("LD_LIBRARY_PATH")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{bin_dir}:{lib}" if lib else str(bin_dir))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, tail)
    return proc.stdout


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench -o json (a list of tests) or -o jsonl: one row a text-generation test."""
    text = text.strip()
    tests = json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    rows = []
    for t in tests:
        if t.get("n_gen", 0) <= 0:  # a prompt-only test: no decode speed
            continue
        rows.append(
            {
                "config": "llama-bench",
                "mode": "plain b1",
                "tokens": t["n_gen"],
                "wall_s": round(t["avg_ns"] / 1e9, 3),
                "tokens_per_s": round(t["avg_ts"], 1),
                "decode_tok_s": round(t["avg_ts"], 1),
                "n_threads": t.get("n_threads"),
            }
        )
    return rows


_MD_COLUMNS = {"PP": "pp", "TG": "tg", "B": "pl", "T_PP s": "t_pp", "S_PP t/s": "speed_pp", "T_TG s": "t_tg"}
_MD_COLUMNS |= {"S_TG t/s": "speed_tg", "T s": "t", "S t/s": "speed"}


def _batched_records(text: str) -> list[dict]:
    """llama-batched-bench's results from --output-format jsonl, or from its default markdown table."""
    records = [json.loads(x) for x in text.splitlines() if x.strip().startswith("{")]
    if records:
        return records
    header = None
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [_MD_COLUMNS.get(c) for c in cells]
        elif not re.fullmatch(r"[-: ]+", "".join(cells)):
            records.append({k: float(v) for k, v in zip(header, cells) if k})
    return records


def parse_batched_bench(text: str) -> list[dict]:
    """One row per number of parallel sequences: mode "plain b1", "plain b8"."""
    rows = []
    for r in _batched_records(text):
        pl, tg = int(r["pl"]), int(r["tg"])
        rows.append(
            {
                "config": "llama-batched-bench",
                "mode": f"plain b{pl}",
                "prompt_tokens": int(r["pp"]),
                "tokens": pl * tg,
                "wall_s": round(r["t_pp"] + r["t_tg"], 3),
                "tokens_per_s": round(pl * tg / (r["t_pp"] + r["t_tg"]), 1),
                "decode_tok_s": round(r["speed_tg"], 1),
                "prefill_s": round(r["t_pp"], 3),
                "prefill_tok_s": round(r["speed_pp"], 1),
            }
        )
    return rows
