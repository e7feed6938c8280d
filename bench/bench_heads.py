"""Learned draft heads against `none`, `suffix` and Hugging Face prompt lookup, on requests the head never saw.

For each generated set (bench/head_sets.py: templated notices and reports, free-text questions, edits): the
target answers the first --train prompts (greedy: the job history a head is distilled from), a head is trained
on them (the code `spec-batch drafters train` runs), and then every row decodes the other --test prompts, side by
side, at each batch size: `none`, `suffix`, `head`, `hybrid` (suffix where confident, the head elsewhere), and
Hugging Face prompt lookup at batch 1 on edits. Each row reports CPU and wall seconds, the speedups over `none`,
accepted tokens per step, and whether its outputs equal `none`'s. The draft cost of one head token is measured
against one batch-1 target forward (the bound in docs/heads.md: 10%).

    python -m bench.bench_heads                                   # all sets, 200 train / 40 test, batch 1 and 8
    python -m bench.bench_heads --sets edits --train 40 --test 8 --max-new-tokens 32 --epochs 2   # smoke

Timings are noise on a shared machine: the lead runs this on a quiet one (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.head_sets import MAKERS, generated_set
from spec_batch import SamplingParams, load_decoder
from spec_batch.core.drafting.job_memory import JobMemory
from spec_batch.core.heads.head import EagleHead
from spec_batch.core.kv.kv_batch import KVBatch
from spec_batch.jobs.head_training import TrainOptions, train_from_pairs
from spec_batch.loading import build_decoder
from spec_batch.loading.heads import HybridHead, drafting_head, load_head, save_head

Run = Callable[[], list]


def draft_cost(decoder, head, context: int = 200, reps: int = 20, width: int = 1) -> dict[str, float]:
    """Milliseconds of one target forward of one token and one head forward of `width` tokens (a tree's depth
    reads several nodes) at batch 1, after `context` tokens. The head as given (drafting_head: as it drafts)."""
    cpu_ids = torch.randint(0, 1000, (1, context))
    dev = decoder.device
    ids, valid, one = (
        cpu_ids.to(dev),
        torch.ones(1, context, dtype=torch.bool, device=dev),
        torch.ones(1, 1, dtype=torch.bool, device=dev),
    )
    hidden = head.config.hidden_size
    with torch.inference_mode():
        target, drafts = KVBatch(decoder.target, dev, 1), KVBatch(head, dev, 1)
        target.forward(ids, valid, 1)
        drafts.forward_output(ids, valid, 1, features=torch.randn(1, context, hidden, device=dev, dtype=head.dtype))
        tok, toks = torch.tensor([[5]], device=dev), torch.full((1, width), 5, device=dev)
        some = torch.ones(1, width, dtype=torch.bool, device=dev)

        def step_target() -> None:
            target.forward(tok, one, 1)
            target.rollback(torch.ones(1, dtype=torch.long, device=dev))

        def step_head() -> None:
            drafts.forward_output(
                toks, some, width, features=torch.randn(1, width, hidden, device=dev, dtype=head.dtype)
            )
            drafts.rollback(torch.full((1,), width, dtype=torch.long, device=dev))

        out = {}
        for name, fn in (("target_ms", step_target), ("head_ms", step_head)):
            for _ in range(3):
                fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[name] = (time.perf_counter() - t0) / reps * 1000
    out["head_vs_target"] = out["head_ms"] / out["target_ms"]
    return out


def rows_for(
    none,
    head,
    kind: str,
    prompts: list,
    params: SamplingParams,
    batch: int,
    full_weights: bool = False,
    tree_widths: tuple[int, ...] = (),
    fixed_depths: tuple[int, ...] = (),
    other_heads: dict[str, EagleHead] | None = None,
) -> dict[str, tuple[Run, list]]:
    """row name -> (run, the per-run stats sink). full_weights: a row for the head drafting in float32 too (the
    default drafts in int8 on the CPU). tree_widths: a row for the head, and one for the hybrid, drafting trees of
    each width at this batch (1: chains).
    fixed_depths: a row for the head drafting at each depth without the policy (trees: depth + width - 1 nodes).
    other_heads: a row `head (LAYOUT)` for each (heads of the other --layouts)."""

    def with_head(draft, weights: str | None = None, tree_width: int | None = None, depth: int | None = None):
        dec = build_decoder(
            none.target,
            none.tokenizer,
            target_name=none.target_name,
            draft=draft,
            device=none.device,
            draft_weights=weights,
            **({} if depth is None else {"num_draft_tokens": depth, "adaptive": False}),
        )
        if tree_width is not None:
            dec.policy.tree_width, dec.policy.tree_batch = tree_width, batch
        return dec

    decoders = {
        "none": none,
        "suffix": load_decoder("default", "suffix"),
        "head": with_head(head),
        "hybrid": with_head(HybridHead(head)),
    }
    if full_weights:
        decoders["head (full weights)"] = with_head(head, "full")
    for width in tree_widths:
        decoders[f"head, tree width {width}"] = with_head(head, tree_width=width)
        decoders[f"hybrid, tree width {width}"] = with_head(HybridHead(head), tree_width=width)
    for depth in fixed_depths:
        decoders[f"head, fixed depth {depth}"] = with_head(head, depth=depth)
    for layout, other in (other_heads or {}).items():
        decoders[f"head ({layout})"] = with_head(other)
    rows: dict[str, tuple[Run, list]] = {}
    for name, dec in decoders.items():
        sink: list = []

        def run(dec=dec, sink=sink) -> list:
            memory = JobMemory()
            results = (
                [dec.generate([p], params, batch_size=1, memory=memory)[0] for p in prompts]
                if batch == 1
                else dec.generate(prompts, params, batch_size=batch, memory=memory)
            )
            sink[:] = results
            return [list(r.token_ids) for r in results]

        rows[name] = (run, sink)
    if batch == 1 and kind == "edits":
        rows["HF prompt lookup 10"] = (_hf_prompt_lookup(none, prompts, params), [])
    return rows


def _hf_prompt_lookup(none, prompts: list, params: SamplingParams) -> Run:
    eos = sorted(none.eos_ids)
    pad = none.tokenizer.pad_token_id if none.tokenizer.pad_token_id is not None else eos[0]

    def run() -> list:
        outs = []
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device=none.device)
            out = none.target.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                prompt_lookup_num_tokens=10,
            )
            outs.append([t for t in out[0, len(p) :].tolist() if t not in eos])
        return outs

    return run


def measure(rows: dict[str, tuple[Run, list]], rounds: int) -> list[dict]:
    for run, _ in rows.values():  # untimed: warms kernels and each policy's step costs
        run()
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    walls: dict[str, list[float]] = {name: [] for name in rows}
    outputs: dict[str, list] = {}
    for _ in range(rounds):
        for name, (run, _) in rows.items():
            t0, w0 = time.process_time(), time.perf_counter()
            outputs[name] = run()
            seconds[name].append(time.process_time() - t0)
            walls[name].append(time.perf_counter() - w0)
    base, base_wall = statistics.median(seconds["none"]), statistics.median(walls["none"])
    table = []
    for name, (_, sink) in rows.items():
        s, w = statistics.median(seconds[name]), statistics.median(walls[name])
        steps = sum(r.stats.target_forwards for r in sink)
        table.append(
            {
                "row": name,
                "seconds": s,
                "vs none": base / s,
                "wall s": w,
                "wall vs none": base_wall / w,
                "accepted/step": (sum(r.stats.accepted_tokens for r in sink) / steps) if steps else None,
                "same as none": all(o[: len(n)] == n for o, n in zip(outputs[name], outputs["none"])),
            }
        )
    return table


def bench_set(none, kind: str, args) -> dict:
    texts = generated_set(kind, args.train + args.test, args.seed)
    prompts = [none.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    answers: list = []  # the target's answers to the training prompts, generated once for every layout
    head, out = _trained_head(none, kind, prompts[: args.train], params, args, args.layouts[0], answers)
    others = {}
    for layout in args.layouts[1:]:
        others[layout], summary = _trained_head(none, kind, prompts[: args.train], params, args, layout, answers)
        out[f"heldout_accepted ({layout})"] = summary["heldout_accepted"]
        out[f"train_s ({layout})"] = summary["train_s"]
    out.update(
        draft_cost=draft_cost(none, drafting_head(head, None)), draft_cost_full=draft_cost(none, head), batches={}
    )
    for batch in args.batch:
        rows = rows_for(
            none,
            head,
            kind,
            prompts[args.train :],
            params,
            batch,
            args.compare_full,
            args.tree_widths,
            args.fixed_depths,
            others,
        )
        out["batches"][batch] = measure(rows, args.rounds)
        _print(kind, batch, out)
    return out


def _trained_head(
    none, kind: str, prompts: list, params: SamplingParams, args, layout: str = "eagle", answers: list | None = None
) -> tuple[EagleHead, dict]:
    """The head of this set: trained on the target's answers to prompts (the job history), or with --heads-dir the
    one a run with the same arguments stored there (training is the slow part of a run; the test prompts differ
    from the training ones either way)."""
    key = f"{kind}-train{args.train}-new{args.max_new_tokens}-ep{args.epochs}-seed{args.seed}"
    key += "" if layout == "eagle" else f"-{layout}"
    stored = Path(args.heads_dir, key) if args.heads_dir else None
    if stored is not None and (stored / "summary.json").is_file():
        summary = json.loads((stored / "summary.json").read_text())
        target = none.target
        return load_head(stored, none.device).attach(
            target.get_input_embeddings(), target.get_output_embeddings()
        ), summary
    t0 = time.perf_counter()
    answers = [] if answers is None else answers  # the caller's list: filled here once, reused by the next layout
    if not answers:
        answers.extend(r.token_ids for r in none.generate(prompts, params, batch_size=8))
    pairs = list(zip(prompts, answers))
    t1 = time.perf_counter()
    trained = train_from_pairs(
        none, pairs, TrainOptions(epochs=args.epochs, max_minutes=args.max_minutes, seed=args.seed, layout=layout)
    )
    summary = {
        "set": kind,
        "history_s": t1 - t0,
        "train_s": time.perf_counter() - t1,
        "heldout_accepted": trained.heldout_accepted_length,
        "heldout_top1": trained.report.top1,
    }
    if stored is not None:
        save_head(trained.head, stored)
        (stored / "summary.json").write_text(json.dumps(summary))
    return trained.head, summary


def _print(kind: str, batch: int, out: dict) -> None:
    cost, full = out["draft_cost"], out["draft_cost_full"]
    print(
        f"\n## {kind}, batch {batch} (head trained in {out['train_s']:.0f}s; held-out accepted/step "
        f"{out['heldout_accepted'] or 0:.2f}; a head token costs {cost['head_vs_target']:.1%} of a batch-1 target "
        f"forward as it drafts, {full['head_vs_target']:.1%} in full weights)"
    )
    for key in [k for k in out if k.startswith("heldout_accepted (")]:
        layout = key[len("heldout_accepted (") : -1]
        print(
            f"(head ({layout}) trained in {out[f'train_s ({layout})']:.0f}s; held-out accepted/step {out[key] or 0:.2f})"
        )
    print(
        "| row | CPU s | vs none | wall s | vs none (wall) | accepted/step | output = none's |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in out["batches"][batch]:
        acc = "—" if r["accepted/step"] is None else f"{r['accepted/step']:.2f}"
        print(
            f"| {r['row']} | {r['seconds']:.2f} | {r['vs none']:.2f}x | {r['wall s']:.2f} | {r['wall vs none']:.2f}x "
            f"| {acc} | {'yes' if r['same as none'] else 'NO'} |"
        )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(MAKERS), help=f"comma-separated among {', '.join(MAKERS)}")
    ap.add_argument("--train", type=int, default=200, help="requests the head learns from (per set)")
    ap.add_argument("--test", type=int, default=40, help="unseen requests measured (per set)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--max-minutes", type=float, default=10.0, help="training time limit per set")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--compare-full", action="store_true", help="add a row with the head drafting in full weights")
    ap.add_argument(
        "--tree-widths",
        type=lambda s: tuple(int(w) for w in s.split(",") if w),
        default=(),
        help="rows for the head drafting at these tree widths (1: chains; `head` drafts at the default)",
    )
    ap.add_argument(
        "--fixed-depths",
        type=lambda s: tuple(int(d) for d in s.split(",") if d),
        default=(),
        help="rows for the head drafting at these depths without the adaptive policy",
    )
    ap.add_argument(
        "--layouts",
        type=lambda s: [x for x in s.split(",") if x],
        default=["eagle"],
        help="head layouts trained per set (eagle, eagle3): the first drafts `head` and `hybrid`, each "
        "other adds a row `head (LAYOUT)`",
    )
    ap.add_argument(
        "--heads-dir",
        default=None,
        help="store each set's trained head here, and reuse it when a later run has the same arguments",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    none = load_decoder("default", "none", device=args.device)
    results = [bench_set(none, kind, args) for kind in args.sets.split(",") if kind.strip()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if all(r["same as none"] for res in results for rows in res["batches"].values() for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
