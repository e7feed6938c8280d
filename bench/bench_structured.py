"""Structured output benchmark: JSON-schema jobs with and without speculation.

On the JSON-schema set of bench/structured_prompts.py (extraction, classification, invoices), greedy, side by
side at each batch size:

  constrained none       the grammar on, plain decoding (one token per target forward): the baseline
  constrained <drafter>  the grammar on, the default drafter (forced tokens drafted with certainty)
  unconstrained none     no grammar, plain decoding: constrained none / this is the cost of the constraint

It prints tokens/s (the target's output tokens, EOS not counted, per second of the set), the ratios, tokens
per step, the share of output tokens that were forced, whether every constrained output validates against its
schema and whether the constrained rows agree token for token, and the grammar's time per step (forced
chains, masks for every verify position, rollback) as a share of a target forward.

    python -m bench.bench_structured                        # batch 1 and 8, every prompt, 3 repeats
    python -m bench.bench_structured --limit 2 --repeats 1  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch

from bench.structured_prompts import SET
from spec_batch import SamplingParams, load_decoder
from spec_batch.core.batch import grammar_step
from spec_batch.core.kv.kv_batch import KVBatch
from spec_batch.settings import get_settings


@dataclass
class Timers:
    """Seconds spent in the grammar's part of the steps and in the target's forward passes (patched in)."""

    grammar_s: float = 0.0
    target_s: float = 0.0
    target_forwards: int = 0  # the loop's steps (one target forward each)


@contextmanager
def timed(target, timers: Timers, sync):
    """Times GrammarStep's methods and the target's step forwards (not prefills) while the block runs."""
    originals = {}

    def wrap(owner, name, sink):
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def run(self, *args, **kwargs):
            prefill = len(args) > 2 or kwargs.get("logits_to_keep", 0) != 0  # a prefill keeps the last logits only
            if sink == "target" and (self.model is not target or prefill):
                return original(self, *args, **kwargs)
            sync()
            t0 = time.perf_counter()
            out = original(self, *args, **kwargs)
            sync()
            dt = time.perf_counter() - t0
            if sink == "target":
                timers.target_s += dt
                timers.target_forwards += 1
            else:
                timers.grammar_s += dt
            return out

        setattr(owner, name, run)

    for name in ("__init__", "extend", "mask", "settle"):
        wrap(grammar_step.GrammarStep, name, "grammar")
    wrap(KVBatch, "forward", "target")
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


@dataclass
class Row:
    label: str
    batch: int
    seconds: list[float] = field(default_factory=list)
    results: list = field(default_factory=list)
    timers: Timers = field(default_factory=Timers)

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    @property
    def tok_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default=None, help="the speculative row's drafter (default: the settings' default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each row (interleaved; the median is used)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the results to this JSON file")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    drafter = args.drafter or get_settings().default_draft
    spec = load_decoder(args.target, drafter, device=args.device)
    base = spec.without_speculation()
    items = SET[: args.limit] if args.limit else SET
    prompts = [spec.apply_chat_template([{"role": "user", "content": text}]) for _, text, _ in items]
    schemas = [schema for _, _, schema in items]
    constrained = [
        SamplingParams(
            max_new_tokens=args.max_new_tokens,
            response_format={"type": "json_schema", "json_schema": {"name": kind, "schema": schema, "strict": True}},
        )
        for kind, _, schema in items
    ]
    free = [SamplingParams(max_new_tokens=args.max_new_tokens)] * len(items)
    sync = torch.cuda.synchronize if spec.device.type == "cuda" else (lambda: None)
    batches = [int(b) for b in args.batch.split(",")]
    rows: dict[tuple[str, int], Row] = {}
    configs = [
        ("constrained none", base, constrained),
        (f"constrained {drafter}", spec, constrained),
        ("unconstrained none", base, free),
    ]
    for _, decoder, params in configs:  # warm-up: every row once, short (and every grammar compiled)
        decoder.generate(
            prompts,
            [SamplingParams(max_new_tokens=4, response_format=p.response_format) for p in params],
            batch_size=max(batches),
        )
    for rep in range(args.repeats):
        for batch in batches:
            for label, decoder, params in configs:
                row = rows.setdefault((label, batch), Row(label, batch))
                timers = Timers()
                with timed(decoder.target, timers, sync):
                    t0 = time.perf_counter()
                    results = decoder.generate(prompts, params, batch_size=batch)
                    row.seconds.append(time.perf_counter() - t0)
                row.results, row.timers = results, timers
                print(f"# run {rep + 1} b{batch} {label}: {row.seconds[-1]:.1f} s", file=sys.stderr, flush=True)
    report = print_table(rows, batches, drafter, schemas, len(items), args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


def print_table(rows, batches, drafter, schemas, n_prompts, args) -> dict:
    print(
        f"# JSON-schema set: {n_prompts} prompts (extraction, classification, invoices), greedy, "
        f"max_new_tokens={args.max_new_tokens}, median of {args.repeats}, device {args.device}"
    )
    head = (
        f"{'batch':>5}  {'row':<24} {'tok/s':>8} {'ratio':>7} {'tok/step':>8} {'forced':>7} {'valid':>7} "
        f"{'stop/length':>11} {'grammar ms/step':>15} {'target ms/fwd':>13} {'share':>6}"
    )
    print(head)
    report: dict = {"drafter": drafter, "prompts": n_prompts, "rows": []}
    for batch in batches:
        plain = rows[("constrained none", batch)]
        for label in ("constrained none", f"constrained {drafter}", "unconstrained none"):
            row = rows[(label, batch)]
            res = row.results
            out = sum(r.stats.output_tokens for r in res)
            per_row_steps = max(1, sum(r.stats.target_forwards for r in res))
            forced = sum(r.stats.forced_tokens for r in res) / max(1, out)
            t = row.timers
            grammar_ms = 1000 * t.grammar_s / max(1, t.target_forwards) if label.startswith("constrained") else 0.0
            target_ms = 1000 * t.target_s / max(1, t.target_forwards)
            share = grammar_ms / target_ms if target_ms else 0.0
            valid = "-"
            if label.startswith("constrained"):
                ok = sum(_valid(r, s) for r, s in zip(res, schemas))
                valid = f"{ok}/{len(res)}"
            ratio = row.tok_s / plain.tok_s
            # an output cut by max_new_tokens inside the structure is invalid by design (finish_reason "length")
            ends = f"{sum(r.finish_reason == 'stop' for r in res)}/{sum(r.finish_reason == 'length' for r in res)}"
            print(
                f"{batch:>5}  {label:<24} {row.tok_s:>8.1f} {ratio:>6.2f}x {out / per_row_steps:>8.2f} {forced:>6.0%} "
                f"{valid:>7} {ends:>11} {grammar_ms:>15.2f} {target_ms:>13.1f} {share:>6.1%}"
            )
            report["rows"].append(
                {
                    "batch": batch,
                    "row": label,
                    "tok_s": row.tok_s,
                    "ratio_to_constrained_none": ratio,
                    "tokens_per_step": out / per_row_steps,
                    "forced_share": forced,
                    "valid": valid,
                    "finish_stop_length": ends,
                    "grammar_ms_per_step": grammar_ms,
                    "target_ms_per_forward": target_ms,
                }
            )
        same = all(
            a.token_ids == b.token_ids
            for a, b in zip(rows[("constrained none", batch)].results, rows[(f"constrained {drafter}", batch)].results)
        )
        free = rows[("unconstrained none", batch)]
        print(
            f"{'':>5}  constrained {drafter} == constrained none token for token: {same}; "
            f"constraint cost (constrained none / unconstrained none): {plain.tok_s / free.tok_s:.2f}x"
        )
    return report


def _valid(result, schema) -> bool:
    if result.finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(result.text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
