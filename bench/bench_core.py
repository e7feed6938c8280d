"""Side-by-side benchmark of the decoding core against Hugging Face `generate` (GitHub issue 2).

One process, the same prompts, greedy decoding, the same EOS and max_new_tokens everywhere:

  core none            the core with no drafter (plain decoding through the same loop): the speedup baseline
  core ngram           the core with prompt lookup
  core self-draft      the target as its own draft model: acceptance must be 100% (checks the all-accepted path;
                       the ratio shows what the loop and the draft forwards cost)
  core tiny-draft      a tiny random Llama as draft (acceptance ~0: shows what a useless draft costs)
  HF greedy            target.generate(do_sample=False)
  HF prompt-lookup     target.generate(prompt_lookup_num_tokens=10)          (Hugging Face: batch 1 only)
  HF assisted self     target.generate(assistant_model=<copy of the target>)  (Hugging Face: batch 1 only)
  HF assisted tiny     target.generate(assistant_model=<the tiny draft>)     (Hugging Face: batch 1 only)

at batch 1 and batched (core batch_size=8; HF batched greedy with left padding). No smaller sibling of the
default model (SmolLM2-135M-Instruct) exists offline, which is why the draft-model rows use the target itself
and a tiny random model. Each configuration runs on a whole prompt set; repeats are interleaved
(A B C A B C ...) and the median wall time is used. tokens/s = output tokens (EOS not counted) / wall seconds.

    python bench/bench_core.py                      # everything (~15 min on a quiet 2-core VM)
    python bench/bench_core.py --quick              # a ~2-minute smoke run
    python bench/bench_core.py --sets edits,free --batch 1 --repeats 3 --threads 1

Then it prints the issue's targets with PASS/MISS, and the time a new process takes to load the default
decoder (issue 3; median of 3 runs after the cache exists).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prompts import DESCRIPTIONS, MAX_NEW_TOKENS, SETS  # noqa: E402

from spec_batch import SamplingParams, load_decoder  # noqa: E402

CLOCK = "wall"  # "wall": tokens per wall-clock second; "cpu": per CPU second of this process (--clock)
COPY_NGRAM = 4  # an output token counts as copied when it lies in a run of >= 4 tokens that also occurs in the prompt
COPY_HEAVY = 0.8  # prompts whose reference output is at least this fraction copied: the ">= 2x none" target
TARGETS_TEXT = {
    "T1": "edits/JSON, batch 1: core ngram >= 1.3x HF prompt lookup",
    "T2": "copy-heavy edits/JSON, batch 1: core ngram >= 2x core none",
    "T3": "free-form: core ngram >= 0.95x core none",
    "T4": "edits, batch 8: core ngram >= 2x HF batched greedy",
    "T5": "issue 3: load_decoder('default') in a new process <= 5 s (median of 3)",
}


# ---------------------------------------------------------------- results


@dataclass
class RunResult:
    outputs: list[list[int]]  # per prompt, EOS stripped
    wall: float  # seconds for the whole set
    cpu: float  # CPU seconds of this process for the whole set
    per_prompt: list[float] | None = None  # seconds per prompt (batch 1 only)
    per_prompt_cpu: list[float] | None = None
    draft_tokens: int = 0
    accepted: int = 0
    steps_tokens: int = 0  # tokens produced by counted steps (EOS included)
    steps: int = 0  # target forwards that produced tokens (per row)
    has_draft_stats: bool = False


@dataclass
class Config:
    key: str
    label: str
    batch: int
    draft_model: bool  # a draft-model row (the target as draft, a tiny random draft): repeated --draft-repeats times
    run: Callable[[list[list[int]], int], RunResult]
    results: list[RunResult] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.results[0].outputs)

    def seconds(self, clock: str | None = None) -> float:
        clock = clock or CLOCK
        return statistics.median(r.cpu if clock == "cpu" else r.wall for r in self.results)

    @property
    def tok_s(self) -> float:
        s = self.seconds()
        return self.tokens / s if s > 0 else float("nan")

    def tok_s_on(self, clock: str) -> float:
        s = self.seconds(clock)
        return self.tokens / s if s > 0 else float("nan")

    def prompt_seconds(self, i: int) -> float:
        if CLOCK == "cpu":
            return statistics.median(r.per_prompt_cpu[i] for r in self.results)  # type: ignore[index]
        return statistics.median(r.per_prompt[i] for r in self.results)  # type: ignore[index]


# ---------------------------------------------------------------- engines


class Bench:
    def __init__(self, args: argparse.Namespace):
        from transformers import LlamaConfig, LlamaForCausalLM

        t0 = time.perf_counter()
        self.dec = load_decoder("default", "ngram")
        self.none = self.dec.without_speculation()
        self.target = self.dec.target
        self.tok = self.dec.tokenizer
        self.eos = sorted(self.dec.eos_ids)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.self_draft = load_decoder("default", draft=self.target)
        torch.manual_seed(args.seed)
        tiny_cfg = LlamaConfig(
            vocab_size=self.dec.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=128, max_position_embeddings=8192,
            bos_token_id=self.tok.bos_token_id, eos_token_id=self.eos[0], pad_token_id=self.pad,
        )
        self.tiny = LlamaForCausalLM(tiny_cfg).to(self.target.dtype).eval()
        self.tiny_draft = load_decoder("default", draft=self.tiny)
        # Hugging Face assisted generation with the target as its own assistant: a separate copy, so that the
        # forward counter on the target sees only the target's forwards
        self.assistant_self = copy.deepcopy(self.target).eval()
        self.forwards = 0
        self.target.register_forward_pre_hook(self._count)
        self.load_s = time.perf_counter() - t0

    def _count(self, module, args) -> None:
        self.forwards += 1

    # core ------------------------------------------------------------------

    def core(self, decoder, batch: int) -> Callable[[list[list[int]], int], RunResult]:
        def run(prompts: list[list[int]], max_new: int) -> RunResult:
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
            per_prompt = per_cpu = None
            t0, c0 = time.perf_counter(), time.process_time()
            if batch == 1:
                results, per_prompt, per_cpu = [], [], []
                for p in prompts:
                    t1, c1 = time.perf_counter(), time.process_time()
                    results += decoder.generate([p], params, batch_size=1)
                    per_prompt.append(time.perf_counter() - t1)
                    per_cpu.append(time.process_time() - c1)
            else:
                results = decoder.generate(prompts, params, batch_size=batch)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            st = [r.stats for r in results]
            return RunResult(
                outputs=[list(r.token_ids) for r in results], wall=wall, cpu=cpu, per_prompt=per_prompt, per_prompt_cpu=per_cpu,
                draft_tokens=sum(s.draft_tokens for s in st), accepted=sum(s.accepted_tokens for s in st),
                steps_tokens=sum(s.output_tokens for s in st), steps=sum(s.target_forwards for s in st),
                has_draft_stats=decoder.draft_name != "none",
            )

        return run

    # Hugging Face -------------------------------------------------------------

    def _hf_kwargs(self, max_new: int) -> dict:
        return dict(max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos, pad_token_id=self.pad)

    def _strip(self, row: list[int]) -> tuple[list[int], int]:
        """Output ids before the first EOS (pad == EOS here); and the generated length with that EOS."""
        for i, t in enumerate(row):
            if t in self.eos:
                return row[:i], i + 1
        return row, len(row)

    def hf1(self, **extra) -> Callable[[list[list[int]], int], RunResult]:
        def run(prompts: list[list[int]], max_new: int) -> RunResult:
            outputs, per_prompt, per_cpu, produced, forwards = [], [], [], 0, 0
            t0, c0 = time.perf_counter(), time.process_time()
            for p in prompts:
                ids = torch.tensor([p], dtype=torch.long)
                f0 = self.forwards
                t1, c1 = time.perf_counter(), time.process_time()
                out = self.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **self._hf_kwargs(max_new), **extra)
                per_prompt.append(time.perf_counter() - t1)
                per_cpu.append(time.process_time() - c1)
                forwards += self.forwards - f0
                o, n = self._strip(out[0, len(p):].tolist())
                outputs.append(o)
                produced += n
            return RunResult(outputs, time.perf_counter() - t0, time.process_time() - c0, per_prompt, per_cpu,
                             steps_tokens=produced, steps=forwards)

        return run

    def hf_batched(self, batch: int) -> Callable[[list[list[int]], int], RunResult]:
        def run(prompts: list[list[int]], max_new: int) -> RunResult:
            outputs = []
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(0, len(prompts), batch):
                group = prompts[s : s + batch]
                width = max(len(p) for p in group)
                ids = torch.full((len(group), width), self.pad, dtype=torch.long)
                mask = torch.zeros((len(group), width), dtype=torch.long)
                for b, p in enumerate(group):  # left padding
                    ids[b, width - len(p):] = torch.tensor(p)
                    mask[b, width - len(p):] = 1
                out = self.target.generate(input_ids=ids, attention_mask=mask, **self._hf_kwargs(max_new))
                outputs += [self._strip(row[width:])[0] for row in out.tolist()]
            return RunResult(outputs, time.perf_counter() - t0, time.process_time() - c0)

        return run

    def configs(self, batches: list[int], hf_pl: list[int], with_drafts: bool) -> list[Config]:
        out: list[Config] = []
        for b in batches:
            bl = "b1" if b == 1 else f"b{b}"
            out += [
                Config(f"core-none-{bl}", "core none", b, False, self.core(self.none, b)),
                Config(f"core-ngram-{bl}", "core ngram", b, False, self.core(self.dec, b)),
            ]
            if with_drafts:
                out += [
                    Config(f"core-self-{bl}", "core self-draft", b, True, self.core(self.self_draft, b)),
                    Config(f"core-tiny-{bl}", "core tiny-draft (random)", b, True, self.core(self.tiny_draft, b)),
                ]
            if b == 1:
                out.append(Config("hf-greedy-b1", "HF greedy", 1, False, self.hf1()))
                for n in hf_pl:
                    out.append(Config(f"hf-pl{n}-b1", f"HF prompt-lookup {n}", 1, False, self.hf1(prompt_lookup_num_tokens=n)))
                if with_drafts:
                    out += [
                        Config("hf-asst-self-b1", "HF assisted self", 1, True, self.hf1(assistant_model=self.assistant_self)),
                        Config("hf-asst-tiny-b1", "HF assisted tiny", 1, True, self.hf1(assistant_model=self.tiny)),
                    ]
            else:
                out.append(Config(f"hf-greedy-{bl}", "HF greedy batched", b, False, self.hf_batched(b)))
        return out


# ---------------------------------------------------------------- analysis helpers


def copy_fraction(prompt: list[int], output: list[int], n: int = COPY_NGRAM) -> float:
    """Fraction of output tokens inside a run of >= n tokens that also occurs in the prompt."""
    if not output:
        return 0.0
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in grams:
            for j in range(i, i + n):
                covered[j] = True
    return sum(covered) / len(output)


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def ratio(a: Config | None, b: Config | None) -> float | None:
    if a is None or b is None or not a.results or not b.results:
        return None
    return a.tok_s / b.tok_s


def subset_tok_s(cfg: Config, idx: list[int]) -> float:
    toks = sum(len(cfg.results[0].outputs[i]) for i in idx)
    return toks / sum(cfg.prompt_seconds(i) for i in idx)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="edits,json,code,free", help="comma list of: " + ",".join(SETS))
    ap.add_argument("--batch", default="1,8", help="comma list of batch sizes (HF prompt lookup/assisted: batch 1 only)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each configuration (median)")
    ap.add_argument("--draft-repeats", type=int, default=1,
                    help="repeats of the draft-model rows (self-draft, tiny draft, HF assisted); they are checks, not targets")
    ap.add_argument("--no-drafts", action="store_true", help="skip the draft-model rows")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override every set's max_new_tokens")
    ap.add_argument("--prompts", type=int, default=None, help="use only the first N prompts of each set")
    ap.add_argument("--hf-pl", default="10", help="comma list of prompt_lookup_num_tokens values for HF prompt lookup")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="what tok/s and the ratios divide by: wall-clock seconds, or this process's CPU seconds "
                         "(meaningful with --threads 1 on a machine shared with other work; both are printed)")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the tiny random draft")
    ap.add_argument("--no-load-time", action="store_true", help="skip the new-process load_decoder timing (issue 3)")
    ap.add_argument("--show", type=int, default=1, help="print this many outputs per set (to see what the model copies)")
    ap.add_argument("--json", default=None, help="also write the raw numbers to this JSON file")
    ap.add_argument("--quick", action="store_true", help="smoke run: edits+free, 3 prompts, 48 tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.sets, args.prompts, args.max_new_tokens, args.repeats = "edits,free", 2, 32, 1
    return args


def load_time(threads: int) -> list[float]:
    """Seconds for `load_decoder('default')` in a fresh interpreter (the converted cache already exists)."""
    code = "from spec_batch import load_decoder; load_decoder('default')"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(Path(__file__).resolve().parent.parent),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    global CLOCK
    args = parse_args(argv)
    CLOCK = args.clock
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown prompt set(s) {unknown}; known: {list(SETS)}")
    batches = [int(b) for b in args.batch.split(",")]
    hf_pl = [int(n) for n in args.hf_pl.split(",") if n.strip()]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    import transformers

    transformers.logging.set_verbosity_error()  # HF's deprecation notices inside assisted generation

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"# spec-batch core benchmark  {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"# CPU: {cpu}, {os.cpu_count()} cores; torch {torch.__version__} ({threads} threads); "
          f"transformers {transformers.__version__}; python {platform.python_version()}")
    load0 = os.getloadavg()
    print(f"# tok/s and ratios use the {CLOCK} clock" + (" (CPU seconds of this process)" if CLOCK == "cpu" else ""))
    print(f"# load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    if load0[0] > (os.cpu_count() or 1):
        print(f"# WARNING: the machine is busy (load {load0[0]:.1f} on {os.cpu_count()} cores): timings are noisy"
              + ("; consider --threads 1" if threads > 1 else ""))
    bench = Bench(args)
    print(f"# models loaded in {bench.load_s:.1f} s: target {bench.dec.target_name} ({bench.target.dtype}), "
          f"eos {bench.eos}; core k_max {bench.dec.policy.k_max}, adaptive {bench.dec.policy.adaptive}")
    configs = bench.configs(batches, hf_pl, with_drafts=not args.no_drafts)

    # warm-up: every configuration once, on short generations
    tw = time.perf_counter()
    warm_prompts = [bench.dec.apply_chat_template([{"role": "user", "content": m}]) for m in SETS["edits"][:8]]
    for cfg in configs:
        cfg.run(warm_prompts[: min(cfg.batch, 2)], 4)
        if cfg.batch > 2:
            cfg.run(warm_prompts[: cfg.batch], 2)
    print(f"# warm-up: {time.perf_counter() - tw:.1f} s")

    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu, "threads": threads, "clock": CLOCK,
                    "torch": torch.__version__, "transformers": transformers.__version__, "sets": {}}
    per_set: dict[str, dict] = {}
    t_all = time.perf_counter()
    for name in sets:
        msgs = SETS[name][: args.prompts] if args.prompts else SETS[name]
        prompts = [bench.dec.apply_chat_template([{"role": "user", "content": m}]) for m in msgs]
        max_new = args.max_new_tokens or MAX_NEW_TOKENS[name]
        fresh = [copy.copy(c) for c in configs]
        for c in fresh:
            c.results = []
        ts = time.perf_counter()
        for r in range(max(args.repeats, args.draft_repeats)):
            for cfg in fresh:
                if r < (args.draft_repeats if cfg.draft_model else args.repeats):
                    cfg.results.append(cfg.run(prompts, max_new))
        per_set[name] = {"configs": fresh, "prompts": prompts, "max_new": max_new}
        print_set(name, prompts, max_new, fresh, bench, args, time.perf_counter() - ts, report)
    total = time.perf_counter() - t_all

    lt = None if args.no_load_time else load_time(threads)
    load1 = os.getloadavg()
    print(f"\n# load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; timed sets: {total:.0f} s")
    print_targets(per_set, lt, report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report["load_average"] = {"start": load0, "end": load1}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def print_set(name, prompts, max_new, cfgs: list[Config], bench: Bench, args, seconds, report) -> None:
    by_key = {c.key: c for c in cfgs}
    ref = by_key.get("hf-greedy-b1") or next((c for c in cfgs if c.key.startswith("hf-greedy")), None)
    ref_out = ref.results[0].outputs if ref else None
    copies = [copy_fraction(p, o) for p, o in zip(prompts, ref_out)] if ref_out else []
    heavy = [i for i, c in enumerate(copies) if c >= COPY_HEAVY]
    pl = next((c for c in cfgs if c.key.startswith("hf-pl") and c.batch == 1), None)
    print(f"\n## {name}: {DESCRIPTIONS[name]}")
    print(f"{len(prompts)} prompts, max_new_tokens={max_new}, prompt tokens {min(map(len, prompts))}-{max(map(len, prompts))}"
          + (f"; reference output {sum(map(len, ref_out))} tokens, copied from the prompt {statistics.mean(copies):.0%} "
             f"(runs of >= {COPY_NGRAM} tokens); copy-heavy prompts (>= {COPY_HEAVY:.0%}): {len(heavy)}" if ref_out else "")
          + f"; {seconds:.0f} s")
    other = "cpu" if CLOCK == "wall" else "wall"
    other_h = "tok/CPU-s" if other == "cpu" else "tok/wall-s"
    header = f"| {'engine':<30} | batch | {'tok/s':>6} | {other_h:>10} | vs none | vs HF greedy | vs HF PL | accept | tok/step | identical |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    set_report = []
    for c in cfgs:
        if not c.results:
            continue
        none = by_key.get(f"core-none-b{c.batch}")
        hf = by_key.get("hf-greedy-b1") if c.batch == 1 else by_key.get(f"hf-greedy-b{c.batch}")
        r0 = c.results[0]
        acc = f"{r0.accepted / r0.draft_tokens:.0%}" if r0.has_draft_stats and r0.draft_tokens else "-"
        tps = f"{r0.steps_tokens / r0.steps:.2f}" if r0.steps else "-"
        same = sum(o == ref for o, ref in zip(r0.outputs, ref_out)) if ref_out else 0
        stable = all(r.outputs == r0.outputs for r in c.results)
        ident = f"{'yes' if same == len(prompts) else 'NO'} {same}/{len(prompts)}" + ("" if stable else " (varies)")
        vs_pl = ratio(c, pl) if c.batch == 1 else None
        reps = f"{len(c.results)}x"
        print(f"| {c.label + ' (' + reps + ')':<30} | {c.batch:>5} | {c.tok_s:6.1f} | {c.tok_s_on(other):10.1f} | {fmt_ratio(ratio(c, none)):>7} | "
              f"{fmt_ratio(ratio(c, hf)):>12} | {fmt_ratio(vs_pl):>8} | {acc:>6} | {tps:>8} | {ident:>9} |")
        if ref_out and same < len(prompts):
            diffs = [(i, first_difference(o, rr), len(rr)) for i, (o, rr) in enumerate(zip(r0.outputs, ref_out)) if o != rr]
            print(f"|   differs from HF greedy b1 at (prompt, token, of): {diffs}")
        set_report.append({
            "key": c.key, "label": c.label, "batch": c.batch, "tok_s": c.tok_s, "tokens": c.tokens,
            "tok_s_wall": c.tok_s_on("wall"), "tok_s_cpu": c.tok_s_on("cpu"),
            "walls": [r.wall for r in c.results], "cpus": [r.cpu for r in c.results], "vs_none": ratio(c, none), "vs_hf": ratio(c, hf), "vs_hf_pl": vs_pl,
            "acceptance": (r0.accepted / r0.draft_tokens) if r0.draft_tokens else None,
            "tokens_per_step": (r0.steps_tokens / r0.steps) if r0.steps else None,
            "identical": same, "of": len(prompts),
        })
    # per-prompt view at batch 1: how much each answer copies, and what ngram buys there
    ng, no = by_key.get("core-ngram-b1"), by_key.get("core-none-b1")
    if ng and no and ng.results and no.results and ref_out:
        print(f"per prompt (batch 1): copied / tokens / ngram acceptance / ngram vs none")
        cells = []
        for i in range(len(prompts)):
            ngs = ng.results[0]
            r = (len(ngs.outputs[i]) / ng.prompt_seconds(i)) / (len(no.results[0].outputs[i]) / no.prompt_seconds(i)) if ngs.outputs[i] else float("nan")
            cells.append(f"[{i}] {copies[i]:.0%}/{len(ref_out[i])}/{r:.2f}x")
        print("  " + "  ".join(cells))
    for i in range(min(args.show, len(prompts))):
        text = bench.tok.decode(ref_out[i]) if ref_out else ""
        print(f"output [{i}] (copied {copies[i]:.0%}): {text[:300]!r}{'...' if len(text) > 300 else ''}")
    report["sets"][name] = {"rows": set_report, "copied": copies, "copy_heavy": heavy, "max_new_tokens": max_new}


def print_targets(per_set: dict, load_times: list[float] | None, report: dict) -> None:
    print("\n## Targets (issue 2, issue 3)")
    rows = []

    def get(name, key):
        s = per_set.get(name)
        if not s:
            return None
        c = next((c for c in s["configs"] if c.key == key and c.results), None)
        return c

    def line(tid, what, value, goal, note=""):
        if value is None:
            rows.append((tid, what, "n/a", "not run", note))
        else:
            rows.append((tid, what, f"{value:.2f}x", "PASS" if value >= goal else "MISS", note))

    for name in ("edits", "json"):
        ng = get(name, "core-ngram-b1")
        pls = [c for c in (per_set.get(name) or {"configs": []})["configs"] if c.key.startswith("hf-pl") and c.results]
        best = max(pls, key=lambda c: c.tok_s) if pls else None
        acc = _acc(ng)
        line("T1", f"{name}: ngram b1 vs {best.label if best else 'HF PL'}", ratio(ng, best), 1.3, f"acceptance {acc}")
    # T2: copy-heavy prompts of edits + json, batch 1, per-prompt timing
    toks_ng = wall_ng = toks_no = wall_no = 0.0
    n_heavy = 0
    accepted = drafted = 0
    for name in ("edits", "json"):
        ng, no = get(name, "core-ngram-b1"), get(name, "core-none-b1")
        if not (ng and no):
            continue
        heavy = report["sets"][name]["copy_heavy"]
        n_heavy += len(heavy)
        for i in heavy:
            toks_ng += len(ng.results[0].outputs[i])
            wall_ng += ng.prompt_seconds(i)
            toks_no += len(no.results[0].outputs[i])
            wall_no += no.prompt_seconds(i)
        # whole-set ratio as context
        line("T2", f"{name}: ngram b1 vs none b1, whole set", ratio(ng, no), 2.0, f"acceptance {_acc(ng)}")
    if n_heavy and wall_ng and wall_no:
        line("T2", f"copy-heavy prompts ({n_heavy}, >= {COPY_HEAVY:.0%} copied): ngram vs none b1",
             (toks_ng / wall_ng) / (toks_no / wall_no), 2.0)
    for b in ("b1", "b8"):
        ng, no = get("free", f"core-ngram-{b}"), get("free", f"core-none-{b}")
        if ng and no:
            line("T3", f"free: ngram {b} vs none {b}", ratio(ng, no), 0.95, f"acceptance {_acc(ng)}")
    ng, hf = get("edits", "core-ngram-b8"), get("edits", "hf-greedy-b8")
    line("T4", "edits: ngram b8 vs HF batched greedy b8", ratio(ng, hf), 2.0, f"acceptance {_acc(ng)}")
    if load_times:
        med = statistics.median(load_times)
        rows.append(("T5", "new-process load_decoder('default')", f"{med:.2f} s", "PASS" if med <= 5.0 else "MISS",
                     "runs: " + ", ".join(f"{t:.2f}" for t in load_times)))
    for tid, what, value, verdict, note in rows:
        print(f"{tid}  {verdict:<7} {value:>7}  {what}" + (f"  ({note})" if note else ""))
    print("goals: " + "; ".join(f"{k}: {v}" for k, v in TARGETS_TEXT.items()))
    report["targets"] = [dict(zip(("id", "what", "value", "verdict", "note"), r)) for r in rows]


def _acc(cfg: Config | None) -> str:
    if not cfg or not cfg.results or not cfg.results[0].draft_tokens:
        return "-"
    r = cfg.results[0]
    return f"{r.accepted / r.draft_tokens:.0%}, {r.steps_tokens / r.steps:.2f} tok/step"


if __name__ == "__main__":
    raise SystemExit(main())
