"""Side-by-side benchmark of the decoding core against Hugging Face `generate`.

One process, the same prompts, greedy decoding, the same EOS and max_new_tokens everywhere:

  core none            the core with no drafter (plain decoding through the same loop): the speedup baseline
  core ngram           the core with prompt lookup (the n-gram drafter)
  core suffix          the core with suffix drafting (the default drafter); each run of a set is one job, with
                       one job memory (the set's earlier outputs help the later requests, as in `spec-batch run`)
  core self-draft      the target as its own draft model: acceptance must be 100% (checks the all-accepted path;
                       the ratio shows what the loop and the draft forwards cost)
  core tiny-draft      a tiny random Llama as draft (acceptance ~0: what a useless draft costs the adaptive loop)
  HF greedy            target.generate(do_sample=False)
  HF prompt-lookup N   target.generate(prompt_lookup_num_tokens=N)           (Hugging Face: batch 1 only)
  HF assisted self     target.generate(assistant_model=<copy of the target>)  (Hugging Face: batch 1 only)
  HF assisted tiny     target.generate(assistant_model=<the tiny draft>)     (Hugging Face: batch 1 only)

at batch 1 and batched (core batch_size=8 with rows leaving as they finish; HF batched greedy with left padding,
rows run until the longest is done). No smaller sibling of the default model (SmolLM2-135M-Instruct) exists
offline, which is why the draft-model rows use the target itself and a tiny random model.

Each configuration runs on a whole prompt set; repeats are interleaved (A B C A B C ...) and the median time
is used. tokens/s = output tokens (EOS not counted) / seconds for the set. --repeats applies to the rows the
targets are computed from; the other rows are shown once (--other-repeats), to keep a full run short.
Outputs are compared token for token with Hugging Face greedy at batch 1.

    python -m bench.bench_core                            # everything
    python -m bench.bench_core --quick                    # a smoke run (~2 minutes)
    python -m bench.bench_core --threads 1 --clock cpu    # on a machine shared with other work (see --clock)
    python -m bench.bench_core --sets edits,free --batch 1 --repeats 3 --no-drafts
    python -m bench.bench_core --sets templated,edits,free --drafter ngram,suffix --no-drafts

At the end it prints the targets with PASS/MISS and the measured ratios, and the time a new process takes to
`load_decoder('default')` once the converted model is cached (median of 3).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from bench.prompts import DESCRIPTIONS, MAX_NEW_TOKENS, SETS
from spec_batch import SamplingParams, load_decoder
from spec_batch.core.drafting.job_memory import JobMemory

CLOCK = "wall"  # "wall": tokens per wall-clock second; "cpu": per CPU second of this process (--clock)
COPY_NGRAM = 4  # an output token counts as copied when it lies in a run of >= 4 tokens that also occurs in the prompt
COPY_HEAVY = 0.8  # prompts whose reference output is at least this fraction copied (the ">= 2x none" target)

TARGETS_TEXT = {
    "T1": "edits and JSON, batch 1: core ngram >= 1.3x HF prompt lookup",
    "T2": "copy-heavy edits/JSON prompts, batch 1: core ngram >= 2x core none",
    "T3": "free-form: core ngram >= 0.95x core none",
    "T4": "edits, batch 8: core ngram >= 2x HF batched greedy",
    "T5": "issue 3: load_decoder('default') in a new process <= 5 s (median of 3)",
    "S1": "issue 11: templated job: core suffix >= 1.5x core none at batch 8, >= 1.8x at batch 1",
    "S2": "issue 11: edits: core suffix b8 >= 1.3x core none b8; core suffix b1 >= 1.3x HF prompt lookup b1",
    "S3": "issue 11: free-form: core suffix >= 0.97x core none at batch 1 and 8",
}
# the rows each target reads, per set: these get --repeats, the rest --other-repeats
TARGET_ROWS = {
    "edits": (
        "core-none-b1",
        "core-ngram-b1",
        "hf-pl",
        "core-ngram-b8",
        "hf-greedy-b8",
        "core-suffix-b1",
        "core-none-b8",
        "core-suffix-b8",
    ),
    "json": ("core-none-b1", "core-ngram-b1", "hf-pl"),
    "free": ("core-none-b1", "core-ngram-b1", "core-none-b8", "core-ngram-b8", "core-suffix-b1", "core-suffix-b8"),
    "templated": ("core-none-b1", "core-suffix-b1", "core-none-b8", "core-suffix-b8"),
    "code": (),
}


def is_target_row(set_name: str, key: str) -> bool:
    return any(
        key == k or (k == "hf-pl" and key.startswith("hf-pl") and key.endswith("-b1"))
        for k in TARGET_ROWS.get(set_name, ())
    )


# ---------------------------------------------------------------- results


@dataclass
class RunResult:
    outputs: list[list[int]]  # per prompt, EOS stripped
    wall: float  # seconds for the whole set
    cpu: float  # CPU seconds of this process for the whole set
    per_prompt: list[float] | None = None  # wall seconds per prompt (batch 1 only)
    per_prompt_cpu: list[float] | None = None
    per_prompt_acc: list[tuple[int, int]] | None = None  # (accepted, drafted) per prompt (core only)
    draft_tokens: int = 0
    accepted: int = 0
    steps_tokens: int = 0  # tokens produced by the counted steps (EOS included)
    steps: int = 0  # target forwards that produced tokens (per row)
    has_draft_stats: bool = False


@dataclass
class Config:
    key: str
    label: str
    batch: int
    draft_model: bool  # a draft-model row (the target as draft, a tiny random draft, HF assisted)
    run: Callable[[list[list[int]], int], RunResult]
    repeats: int = 1
    results: list[RunResult] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.results[0].outputs)

    def seconds(self, clock: str | None = None) -> float:
        clock = clock or CLOCK
        return statistics.median(r.cpu if clock == "cpu" else r.wall for r in self.results)

    def tok_s(self, clock: str | None = None) -> float:
        s = self.seconds(clock)
        return self.tokens / s if s > 0 else float("nan")

    def prompt_seconds(self, i: int) -> float:
        if CLOCK == "cpu":
            return statistics.median(r.per_prompt_cpu[i] for r in self.results)  # type: ignore[index]
        return statistics.median(r.per_prompt[i] for r in self.results)  # type: ignore[index]

    def prompt_tok_s(self, i: int) -> float:
        n = len(self.results[0].outputs[i])
        return n / self.prompt_seconds(i) if n else float("nan")


# ---------------------------------------------------------------- engines


class Bench:
    def __init__(self, seed: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        t0 = time.perf_counter()
        self.dec = load_decoder("default", "ngram")
        self.none = self.dec.without_speculation()
        self.drafters = {"ngram": self.dec, "suffix": load_decoder("default", "suffix")}  # one loaded target
        self.target = self.dec.target
        self.tok = self.dec.tokenizer
        self.eos = sorted(self.dec.eos_ids)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.self_draft = load_decoder("default", draft=self.target)
        torch.manual_seed(seed)
        tiny_cfg = LlamaConfig(
            vocab_size=self.dec.vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=128,
            max_position_embeddings=8192,
            bos_token_id=self.tok.bos_token_id,
            eos_token_id=self.eos[0],
            pad_token_id=self.pad,
        )
        self.tiny = LlamaForCausalLM(tiny_cfg).to(self.target.dtype).eval()
        self.tiny_draft = load_decoder("default", draft=self.tiny)
        # HF assisted generation with the target as its own assistant uses a copy, so that the forward counter on
        # the target counts the target's forwards only
        self.assistant_self = copy.deepcopy(self.target).eval()
        self.forwards = 0
        self.target.register_forward_pre_hook(self._count)
        self.load_s = time.perf_counter() - t0

    def _count(self, module, args) -> None:
        self.forwards += 1

    def chat(self, message: str) -> list[int]:
        return self.dec.apply_chat_template([{"role": "user", "content": message}])

    # core ------------------------------------------------------------------

    def core(self, decoder, batch: int) -> Callable[[list[list[int]], int], RunResult]:
        def run(prompts: list[list[int]], max_new: int) -> RunResult:
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
            per_prompt = per_cpu = None
            memory = JobMemory()  # each run of a set is one job (drafters other than suffix ignore it)
            t0, c0 = time.perf_counter(), time.process_time()
            if batch == 1:
                results, per_prompt, per_cpu = [], [], []
                for p in prompts:
                    t1, c1 = time.perf_counter(), time.process_time()
                    results += decoder.generate([p], params, batch_size=1, memory=memory)
                    per_prompt.append(time.perf_counter() - t1)
                    per_cpu.append(time.process_time() - c1)
            else:
                results = decoder.generate(prompts, params, batch_size=batch, memory=memory)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            st = [r.stats for r in results]
            return RunResult(
                outputs=[list(r.token_ids) for r in results],
                wall=wall,
                cpu=cpu,
                per_prompt=per_prompt,
                per_prompt_cpu=per_cpu,
                per_prompt_acc=[(s.accepted_tokens, s.draft_tokens) for s in st],
                draft_tokens=sum(s.draft_tokens for s in st),
                accepted=sum(s.accepted_tokens for s in st),
                steps_tokens=sum(s.output_tokens for s in st),
                steps=sum(s.target_forwards for s in st),
                has_draft_stats=decoder.draft_name != "none",
            )

        return run

    # Hugging Face -------------------------------------------------------------

    def _hf_kwargs(self, max_new: int) -> dict:
        return dict(max_new_tokens=max_new, do_sample=False, eos_token_id=self.eos, pad_token_id=self.pad)

    def _strip(self, row: list[int]) -> tuple[list[int], int]:
        """Output ids before the first EOS (pad == EOS here), and the generated length with that EOS."""
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
                out = self.target.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), **self._hf_kwargs(max_new), **extra
                )
                per_prompt.append(time.perf_counter() - t1)
                per_cpu.append(time.process_time() - c1)
                forwards += self.forwards - f0  # every HF target forward yields >= 1 token (prefill included)
                o, n = self._strip(out[0, len(p) :].tolist())
                outputs.append(o)
                produced += n
            return RunResult(
                outputs,
                time.perf_counter() - t0,
                time.process_time() - c0,
                per_prompt,
                per_cpu,
                steps_tokens=produced,
                steps=forwards,
            )

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
                    ids[b, width - len(p) :] = torch.tensor(p)
                    mask[b, width - len(p) :] = 1
                out = self.target.generate(input_ids=ids, attention_mask=mask, **self._hf_kwargs(max_new))
                outputs += [self._strip(row[width:])[0] for row in out.tolist()]
            return RunResult(outputs, time.perf_counter() - t0, time.process_time() - c0)

        return run

    def configs(self, batches: list[int], hf_pl: list[int], with_drafts: bool, drafters: list[str]) -> list[Config]:
        out: list[Config] = []
        for b in batches:
            bl = f"b{b}"
            out.append(Config(f"core-none-{bl}", "core none", b, False, self.core(self.none, b)))
            out += [Config(f"core-{d}-{bl}", f"core {d}", b, False, self.core(self.drafters[d], b)) for d in drafters]
            if with_drafts:
                out += [
                    Config(f"core-self-{bl}", "core self-draft", b, True, self.core(self.self_draft, b)),
                    Config(f"core-tiny-{bl}", "core tiny random draft", b, True, self.core(self.tiny_draft, b)),
                ]
            if b == 1:
                out.append(Config("hf-greedy-b1", "HF greedy", 1, False, self.hf1()))
                for n in hf_pl:
                    out.append(
                        Config(f"hf-pl{n}-b1", f"HF prompt-lookup {n}", 1, False, self.hf1(prompt_lookup_num_tokens=n))
                    )
                if with_drafts:
                    out += [
                        Config(
                            "hf-asst-self-b1",
                            "HF assisted self",
                            1,
                            True,
                            self.hf1(assistant_model=self.assistant_self),
                        ),
                        Config(
                            "hf-asst-tiny-b1", "HF assisted tiny random", 1, True, self.hf1(assistant_model=self.tiny)
                        ),
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
    return a.tok_s() / b.tok_s()


def acceptance_text(cfg: Config | None) -> str:
    if not cfg or not cfg.results or not cfg.results[0].draft_tokens:
        return "-"
    r = cfg.results[0]
    return f"acceptance {r.accepted / r.draft_tokens:.0%}, {r.steps_tokens / r.steps:.2f} tokens/step"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="edits,json,code,free", help="comma list of: " + ",".join(SETS))
    ap.add_argument(
        "--batch", default="1,8", help="comma list of batch sizes (HF prompt lookup/assisted: batch 1 only)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the rows the targets read (median)")
    ap.add_argument("--other-repeats", type=int, default=1, help="repeats of every other row")
    ap.add_argument(
        "--draft-sets",
        default="edits",
        help="sets on which the draft-model rows run (self-draft, tiny draft, HF assisted); 'all' or a comma list",
    )
    ap.add_argument("--no-drafts", action="store_true", help="skip the draft-model rows")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override every set's max_new_tokens")
    ap.add_argument("--prompts", "--limit", type=int, default=None, help="use only the first N prompts of each set")
    ap.add_argument(
        "--drafter",
        default="ngram,suffix",
        help="comma list of the core's drafters run side by side with core none: ngram, suffix; NAME@K sets "
        "num_draft_tokens=K (e.g. suffix@16), +OPTION=VALUE a drafter option (suffix@16+max_spec_factor=2)",
    )
    ap.add_argument("--hf-pl", default="10", help="comma list of prompt_lookup_num_tokens values for HF prompt lookup")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what tok/s and the ratios divide by: wall-clock seconds, or this process's CPU seconds "
        "(meaningful with --threads 1 on a machine shared with other work; both are printed)",
    )
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the tiny random draft")
    ap.add_argument("--no-load-time", action="store_true", help="skip the new-process load_decoder timing")
    ap.add_argument("--show", type=int, default=1, help="print the first characters of this many outputs per set")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--quick", action="store_true", help="smoke run: edits+free, 2 prompts, 32 tokens, 1 repeat")
    args = ap.parse_args(argv)
    if args.other_repeats < 1 or args.repeats < 1:
        ap.error(
            "--repeats and --other-repeats must be >= 1 (the Hugging Face rows are the reference every output is checked against)"
        )
    if args.quick:
        args.sets, args.prompts, args.max_new_tokens, args.repeats = "edits,free", 2, 32, 1
    return args


def load_time(threads: int) -> list[float]:
    """Seconds for `load_decoder('default')` in a fresh interpreter (the converted model is already cached)."""
    code = "from spec_batch import load_decoder; load_decoder('default')"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            env=env,
            cwd=str(ROOT),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        times.append(time.perf_counter() - t0)
    return times


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    global CLOCK
    args = parse_args(argv)
    CLOCK = args.clock
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown prompt set(s) {unknown}; known: {list(SETS)}")
    draft_sets = set(SETS) if args.draft_sets == "all" else {s.strip() for s in args.draft_sets.split(",")}
    batches = [int(b) for b in args.batch.split(",")]
    hf_pl = [int(n) for n in args.hf_pl.split(",") if n.strip()]
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # explicit, and printed: it changes every number below
    import transformers

    transformers.logging.set_verbosity_error()  # HF's deprecation notices from inside assisted generation

    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu_name = next(l.split(":", 1)[1].strip() for l in info if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load0 = os.getloadavg()
    print(f"# spec-batch core benchmark, {started}")
    print(
        f"# CPU: {cpu_name}, {os.cpu_count()} cores; torch {torch.__version__}, {threads} thread(s); "
        f"transformers {transformers.__version__}; python {platform.python_version()}"
    )
    print(
        f"# tok/s and the ratios use the {CLOCK} clock"
        + (
            " (CPU seconds of this process; the wall-clock rate is the other column)"
            if CLOCK == "cpu"
            else " (the rate per CPU second of this process is the other column)"
        )
    )
    print(f"# load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    if load0[0] > (os.cpu_count() or 1):
        print(
            f"# WARNING: the machine is busy (load {load0[0]:.1f} on {os.cpu_count()} cores): wall-clock timings are noisy"
            + ("; consider --threads 1 --clock cpu" if threads > 1 or CLOCK == "wall" else "")
        )
    bench = Bench(args.seed)
    agc = bench.assistant_self.generation_config
    try:  # what generate() fills in where the model's generation config leaves these unset
        hf_defaults = type(agc)._get_default_generation_params()
    except AttributeError:
        hf_defaults = {}

    def asst(name: str):
        value = getattr(agc, name, None)
        return value if value is not None else hf_defaults.get(name)

    print(
        f"# models loaded in {bench.load_s:.1f} s: target {bench.dec.target_name} ({bench.target.dtype}), eos {bench.eos}; "
        f"core num_draft_tokens {bench.dec.policy.k_max}, adaptive {bench.dec.policy.adaptive}; HF assisted: "
        f"num_assistant_tokens {asst('num_assistant_tokens')} ({asst('num_assistant_tokens_schedule')}), "
        f"confidence threshold {asst('assistant_confidence_threshold')}; HF prompt lookup: "
        f"max_matching_ngram_size {asst('max_matching_ngram_size') or 2} (HF defaults)"
    )
    drafters = [d.strip() for d in args.drafter.split(",") if d.strip()]
    for (
        d
    ) in drafters:  # NAME[@K][+OPTION=VALUE...]: num_draft_tokens=K, drafter_options, e.g. suffix@16+max_spec_factor=2
        head, *opts = d.split("+")
        name, _, k = head.partition("@")
        if (k or opts) and name in bench.drafters:
            options = {key: float(value) for key, _, value in (o.partition("=") for o in opts)}
            sizes = {"num_draft_tokens": int(k)} if k else {}  # else load_decoder's own default
            bench.drafters[d] = load_decoder("default", name, drafter_options=options, **sizes)
    if set(drafters) - set(bench.drafters):
        raise SystemExit(
            f"unknown drafter(s) {sorted(set(drafters) - set(bench.drafters))}; known: {list(bench.drafters)}"
        )
    configs = bench.configs(batches, hf_pl, with_drafts=not args.no_drafts, drafters=drafters)

    tw = time.perf_counter()  # warm-up: every configuration once, on short generations
    warm = [bench.chat(m) for m in SETS["edits"][:8]]
    for cfg in configs:
        cfg.run(warm[: min(cfg.batch, 2)], 4)
        if cfg.batch > 2:
            cfg.run(warm[: cfg.batch], 2)
    print(f"# warm-up: {time.perf_counter() - tw:.1f} s")

    report: dict = {
        "date": started,
        "cpu": cpu_name,
        "cores": os.cpu_count(),
        "threads": threads,
        "clock": CLOCK,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "argv": sys.argv[1:],
        "sets": {},
    }
    per_set: dict[str, dict] = {}
    t_all = time.perf_counter()
    for name in sets:
        msgs = SETS[name][: args.prompts] if args.prompts else SETS[name]
        prompts = [bench.chat(m) for m in msgs]
        max_new = args.max_new_tokens or MAX_NEW_TOKENS[name]
        cfgs = []
        for c in configs:
            if c.draft_model and name not in draft_sets:
                continue
            c = copy.copy(c)
            c.results = []
            c.repeats = args.repeats if is_target_row(name, c.key) else args.other_repeats
            cfgs.append(c)
        ts = time.perf_counter()
        for r in range(max(c.repeats for c in cfgs)):
            for cfg in cfgs:  # interleaved: A B C A B C ...
                if r < cfg.repeats:
                    t1 = time.perf_counter()
                    cfg.results.append(cfg.run(prompts, max_new))
                    progress(f"  {name} #{r + 1} {cfg.label} b{cfg.batch}: {time.perf_counter() - t1:.1f} s")
        per_set[name] = {"configs": cfgs, "prompts": prompts}
        print_set(name, prompts, max_new, cfgs, bench, args, time.perf_counter() - ts, report)
    total = time.perf_counter() - t_all

    lt = None if args.no_load_time else load_time(threads)
    load1 = os.getloadavg()
    print(f"\n# load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; the timed sets took {total:.0f} s")
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
    print(f"\n## {name}: {DESCRIPTIONS[name]}\n")
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, max_new_tokens={max_new}"
        + (
            f"; reference output {sum(map(len, ref_out))} tokens, {statistics.mean(copies):.0%} of them copied from "
            f"the prompt (runs of >= {COPY_NGRAM} tokens); copy-heavy prompts (>= {COPY_HEAVY:.0%} copied): {len(heavy)}"
            if ref_out
            else ""
        )
        + f"; {seconds:.0f} s\n"
    )
    other = "cpu" if CLOCK == "wall" else "wall"
    other_h = "tok/CPU-s" if other == "cpu" else "tok/wall-s"
    header = (
        f"| {'engine (runs)':<30} | batch | {'tok/s':>6} | {other_h:>10} | vs none | vs HF greedy | vs HF PL "
        f"| accept | tok/step | identical |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    rows_report, notes = [], []
    for c in cfgs:
        if not c.results:
            continue
        none = by_key.get(f"core-none-b{c.batch}")
        hf = by_key.get(f"hf-greedy-b{c.batch}")
        r0 = c.results[0]
        acc = f"{r0.accepted / r0.draft_tokens:.0%}" if r0.has_draft_stats and r0.draft_tokens else "-"
        tps = f"{r0.steps_tokens / r0.steps:.2f}" if r0.steps else "-"
        same = sum(o == rr for o, rr in zip(r0.outputs, ref_out)) if ref_out else 0
        stable = all(r.outputs == r0.outputs for r in c.results)
        ident = f"{'yes' if same == len(prompts) else 'NO'} {same}/{len(prompts)}" + ("" if stable else " varies")
        vs_pl = ratio(c, pl) if c.batch == 1 else None
        label = f"{c.label} ({len(c.results)})"
        print(
            f"| {label:<30} | {c.batch:>5} | {c.tok_s():6.1f} | {c.tok_s(other):10.1f} | {fmt_ratio(ratio(c, none)):>7} | "
            f"{fmt_ratio(ratio(c, hf)):>12} | {fmt_ratio(vs_pl):>8} | {acc:>6} | {tps:>8} | {ident:>9} |"
        )
        if ref_out and same < len(prompts):
            diffs = [
                (i, first_difference(o, rr), len(rr)) for i, (o, rr) in enumerate(zip(r0.outputs, ref_out)) if o != rr
            ]
            notes.append(f"{c.label} b{c.batch} differs from HF greedy b1 at (prompt, first token, of): {diffs}")
        rows_report.append(
            {
                "key": c.key,
                "label": c.label,
                "batch": c.batch,
                "runs": len(c.results),
                "tokens": c.tokens,
                "tok_s": c.tok_s(),
                "tok_s_wall": c.tok_s("wall"),
                "tok_s_cpu": c.tok_s("cpu"),
                "walls": [r.wall for r in c.results],
                "cpus": [r.cpu for r in c.results],
                "vs_none": ratio(c, none),
                "vs_hf": ratio(c, hf),
                "vs_hf_pl": vs_pl,
                "acceptance": (r0.accepted / r0.draft_tokens) if r0.draft_tokens else None,
                "tokens_per_step": (r0.steps_tokens / r0.steps) if r0.steps else None,
                "identical": same,
                "of": len(prompts),
                "stable": stable,
            }
        )
    print(
        "\nHF prompt lookup and assisted generation run at batch 1 only (Hugging Face supports nothing else). "
        "Draft-model rows: no smaller sibling of the default model exists offline, so they use the target as its "
        "own draft (acceptance must be 100%) and a tiny random Llama (acceptance ~0). identical: token ids equal "
        "to HF greedy at batch 1."
    )
    for n in notes:
        print(f"\n{n}")
    # per prompt at batch 1: how much each answer copies, and what ngram buys there
    ng, no = by_key.get("core-ngram-b1"), by_key.get("core-none-b1")
    per_prompt = []
    if ng and no and ng.results and no.results and ref_out and ng.results[0].per_prompt:
        print("\nper prompt, batch 1: | prompt | tokens | copied | ngram acceptance | ngram vs none | ngram vs HF PL |")
        for i in range(len(prompts)):
            a, d = ng.results[0].per_prompt_acc[i]  # type: ignore[index]
            vs_none = ng.prompt_tok_s(i) / no.prompt_tok_s(i) if ref_out[i] else float("nan")
            vs_pl = ng.prompt_tok_s(i) / pl.prompt_tok_s(i) if pl and ref_out[i] else None
            acc = f"{a / d:.0%}" if d else "-"
            print(f"  | {i} | {len(ref_out[i])} | {copies[i]:.0%} | {acc} | {vs_none:.2f}x | {fmt_ratio(vs_pl)} |")
            per_prompt.append(
                {
                    "tokens": len(ref_out[i]),
                    "copied": copies[i],
                    "acceptance": a / d if d else None,
                    "ngram_vs_none": vs_none,
                    "ngram_vs_hf_pl": vs_pl,
                }
            )
    for i in range(min(args.show, len(prompts))):
        text = bench.tok.decode(ref_out[i]) if ref_out else ""
        print(f"\noutput [{i}] ({copies[i]:.0%} copied): {text[:240]!r}{'...' if len(text) > 240 else ''}")
    report["sets"][name] = {
        "rows": rows_report,
        "per_prompt": per_prompt,
        "copy_heavy": heavy,
        "max_new_tokens": max_new,
        "prompts": len(prompts),
        "seconds": seconds,
    }


def print_targets(per_set: dict, load_times: list[float] | None, report: dict) -> None:
    print("\n## Targets (issues 2, 3 and 11)\n")
    rows = []

    def get(name, key):
        s = per_set.get(name)
        return next((c for c in s["configs"] if c.key == key and c.results), None) if s else None

    def line(tid, what, value, goal, note=""):
        if value is None or value != value:
            rows.append((tid, what, "n/a", "not run", note))
        else:
            verdict = "info" if goal is None else "PASS" if value >= goal else "MISS"
            rows.append((tid, what, f"{value:.2f}x", verdict, note))

    for name in ("edits", "json"):
        if name not in per_set:
            continue
        ng = get(name, "core-ngram-b1")
        pls = [c for c in per_set[name]["configs"] if c.key.startswith("hf-pl") and c.batch == 1 and c.results]
        best = max(pls, key=lambda c: c.tok_s()) if pls else None
        line(
            "T1",
            f"{name}: core ngram b1 / {best.label if best else 'HF prompt-lookup'} b1",
            ratio(ng, best),
            1.3,
            acceptance_text(ng),
        )
    toks_ng = s_ng = toks_no = s_no = 0.0
    n_heavy = 0
    for name in ("edits", "json"):
        ng, no = get(name, "core-ngram-b1"), get(name, "core-none-b1")
        if not (ng and no and ng.results[0].per_prompt):
            continue
        for i in report["sets"][name]["copy_heavy"]:
            n_heavy += 1
            toks_ng += len(ng.results[0].outputs[i])
            s_ng += ng.prompt_seconds(i)
            toks_no += len(no.results[0].outputs[i])
            s_no += no.prompt_seconds(i)
        line(
            "T2",
            f"{name}, whole set (context, not the target): core ngram b1 / core none b1",
            ratio(ng, no),
            None,
            acceptance_text(ng),
        )
    if n_heavy:
        line(
            "T2",
            f"copy-heavy edits/JSON prompts ({n_heavy}, >= {COPY_HEAVY:.0%} copied): core ngram b1 / core none b1",
            (toks_ng / s_ng) / (toks_no / s_no),
            2.0,
        )
    for b in ("b1", "b8"):
        ng, no = get("free", f"core-ngram-{b}"), get("free", f"core-none-{b}")
        if ng and no:
            line("T3", f"free: core ngram {b} / core none {b}", ratio(ng, no), 0.95, acceptance_text(ng))
    if "edits" in per_set:
        ng, hf = get("edits", "core-ngram-b8"), get("edits", "hf-greedy-b8")
        line("T4", "edits: core ngram b8 / HF batched greedy b8", ratio(ng, hf), 2.0, acceptance_text(ng))
    for b, goal in (("b8", 1.5), ("b1", 1.8)):
        sx, no = get("templated", f"core-suffix-{b}"), get("templated", f"core-none-{b}")
        if sx and no:
            line("S1", f"templated job: core suffix {b} / core none {b}", ratio(sx, no), goal, acceptance_text(sx))
    if "edits" in per_set:
        sx, no = get("edits", "core-suffix-b8"), get("edits", "core-none-b8")
        if sx and no:
            line("S2", "edits: core suffix b8 / core none b8", ratio(sx, no), 1.3, acceptance_text(sx))
        sx = get("edits", "core-suffix-b1")
        pls = [c for c in per_set["edits"]["configs"] if c.key.startswith("hf-pl") and c.batch == 1 and c.results]
        best = max(pls, key=lambda c: c.tok_s()) if pls else None
        if sx and best:
            line("S2", f"edits: core suffix b1 / {best.label} b1", ratio(sx, best), 1.3, acceptance_text(sx))
    for b in ("b1", "b8"):
        sx, no = get("free", f"core-suffix-{b}"), get("free", f"core-none-{b}")
        if sx and no:
            line("S3", f"free: core suffix {b} / core none {b}", ratio(sx, no), 0.97, acceptance_text(sx))
    if load_times:
        med = statistics.median(load_times)
        rows.append(
            (
                "T5",
                "new process: load_decoder('default')",
                f"{med:.2f} s",
                "PASS" if med <= 5.0 else "MISS",
                "runs " + ", ".join(f"{t:.2f}" for t in load_times) + " s (interpreter start and imports included)",
            )
        )
    print("| target | verdict | measured | what |")
    print("|--------|---------|----------|------|")
    for tid, what, value, verdict, note in rows:
        print(f"| {tid} | {verdict} | {value} | {what}" + (f" ({note})" if note else "") + " |")
    print("\ngoals: " + "; ".join(f"{k}: {v}" for k, v in TARGETS_TEXT.items()))
    report["targets"] = [dict(zip(("id", "what", "value", "verdict", "note"), r)) for r in rows]


if __name__ == "__main__":
    raise SystemExit(main())
