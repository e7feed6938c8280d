"""Does speculation survive a busy machine? A reproduction of a busy spell, as a check (exit 1 when it fails).

A short job (8 requests: 4 copy-heavy edits, 4 free answers, outputs of 16-48 tokens) is decoded by the default
model with the suffix drafter and the job's memory, as `spec-batch run` does, while N CPU-bound processes share the
machine (default 2). The adaptive policy sees noisy step costs; without probes (`--no-cost-probes`) a free drafter
can switch drafting off for the whole job (0 draft tokens). The job runs twice on the same decoder (a worker keeps
its decoder, and its policy, across jobs): both runs must draft.

    python -m bench.bench_busy_policy [--burners 2] [--drafter suffix] [--batch-size 8]

Prints draft tokens, acceptance and wall time per run. Timings on a shared machine are noise; the check is that
drafting happens.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time

from bench.prompts import EDITS, FREE
from spec_batch import JobMemory, SamplingParams, load_decoder


def _burn() -> None:
    x = 0
    while True:  # pure Python: one core each, until terminated
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def short_job(seed: int = 0) -> tuple[list[str], list[SamplingParams]]:
    """8 requests, edits and free answers interleaved, each with its own budget of 16-48 tokens."""
    rng = random.Random(seed)
    messages = [m for pair in zip(EDITS[:4], FREE[:4]) for m in pair]
    return messages, [SamplingParams(max_new_tokens=rng.randint(16, 48)) for _ in messages]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burners", type=int, default=2, help="CPU-bound processes running beside the job")
    ap.add_argument("--drafter", default="suffix")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="jobs decoded one after another on the same decoder")
    ap.add_argument(
        "--no-cost-probes",
        action="store_true",
        help="the policy without cost probes for free drafters (they never probe once off): the comparison",
    )
    args = ap.parse_args(argv)
    decoder = load_decoder("default", args.drafter)
    if args.no_cost_probes:
        decoder.policy.cost_probe_first = 10**9
    messages, params = short_job()
    prompts = [decoder.apply_chat_template([{"role": "user", "content": m}]) for m in messages]
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    ok = True
    try:
        for run in range(args.runs):
            t0 = time.perf_counter()
            results = decoder.generate(prompts, params, batch_size=args.batch_size, memory=JobMemory())
            wall = time.perf_counter() - t0
            drafted = sum(r.stats.draft_tokens for r in results)
            accepted = sum(r.stats.accepted_tokens for r in results)
            out = sum(len(r.token_ids) for r in results)
            rate = f"{accepted / drafted:.0%}" if drafted else "-"
            print(
                f"run {run + 1}: {out} tokens in {wall:.1f} s with {args.burners} burner(s); "
                f"drafted {drafted}, accepted {accepted} ({rate})"
            )
            ok = ok and drafted > 0
    finally:
        for b in burners:
            b.terminate()
            b.join()
    print("OK: the policy drafted in every run" if ok else "FAIL: a run drafted nothing")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
