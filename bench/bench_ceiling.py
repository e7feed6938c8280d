"""The ceiling of a draft-length policy on the suffix drafter's proposals, measured with real forwards.

bench_replay.py estimates it from a cost model; this runs it. The greedy outputs are decoded once with `none`
(every drafter's greedy output is token-identical to it); then, side by side in interleaved rounds:

  none            plain decoding
  suffix          the default drafter and policy
  oracle fF       the suffix drafter at max_spec_factor F with each proposal cut to the run the target will
                  accept (known from the reference outputs): a policy that never wastes a draft token
  HF PL 10        Hugging Face prompt lookup (batch 1 only), what copy-heavy edits are measured against

If even `oracle` misses a target, no policy on these proposals reaches it on this machine: it takes other
proposals or cheaper verify tokens (another accelerator).

    python -m bench.bench_ceiling --set edits --batch 1 --rounds 3 --factors 2,16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from bench.prompts import MAX_NEW_TOKENS, SETS
from spec_batch import load_decoder
from spec_batch.core.batch.rows import matched_run
from spec_batch.core.drafting.drafters import DraftRow
from spec_batch.core.drafting.job_memory import JobMemory
from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
from spec_batch.core.params import SamplingParams


class OracleSuffixDrafter(SuffixDrafter):
    """The suffix drafter's proposals, each cut to the part the target accepts: `known` maps a prompt's ids to
    its greedy output ids."""

    def __init__(self, known: dict[tuple[int, ...], list[int]], **options):
        super().__init__(**options)
        self.known = known

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        super().available(rows, k_max)
        for row, draft in zip(rows, self._cached):
            prompt_len = len(row.tokens) - row.n_generated
            run = matched_run(draft.tokens, self.known[tuple(row.tokens[:prompt_len])][row.n_generated :])
            draft.tokens, draft.probs = draft.tokens[:run], draft.probs[:run]
        return [len(d.tokens) for d in self._cached]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="edits", choices=sorted(SETS), help="bench/prompts.py set, one job")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (medians), after one untimed")
    ap.add_argument("--factors", default="2,16", help="comma list of max_spec_factor values for oracle rows")
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts of the set")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the set's max_new_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.rounds < 1:
        raise SystemExit("--batch and --rounds must be >= 1")
    factors = [float(f) for f in args.factors.split(",") if f.strip()]
    torch.set_num_threads(args.threads)

    none = load_decoder("default", "none")
    tok = none.tokenizer
    prompts = [none.apply_chat_template([{"role": "user", "content": m}]) for m in SETS[args.set][: args.prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens or MAX_NEW_TOKENS[args.set], temperature=0.0)
    reference = [list(r.token_ids) for r in none.generate(prompts, params, batch_size=args.batch)]
    known = {tuple(p): o for p, o in zip(prompts, reference)}

    def core(decoder) -> Callable[[], list[list[int]]]:
        def run() -> list[list[int]]:
            memory = JobMemory()  # one job per run, as bench_core runs a set
            if args.batch == 1:
                return [list(decoder.generate([p], params, batch_size=1, memory=memory)[0].token_ids) for p in prompts]
            return [list(r.token_ids) for r in decoder.generate(prompts, params, batch_size=args.batch, memory=memory)]

        return run

    def oracle(factor: float):
        decoder = load_decoder("default", "suffix")  # the loaded target is shared
        return decoder.with_drafter(lambda: OracleSuffixDrafter(known, max_spec_factor=factor))

    def hf_prompt_lookup() -> list[list[int]]:
        eos = sorted(none.eos_ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        outs = []
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long)
            out = none.target.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                prompt_lookup_num_tokens=10,
            )
            outs.append(out[0, len(p) :].tolist())
        return outs

    rows: dict[str, Callable[[], list[list[int]]]] = {
        "none": core(none),
        "suffix": core(load_decoder("default", "suffix")),
    }
    rows.update({f"oracle f{f:g}": core(oracle(f)) for f in factors})
    if args.batch == 1:
        rows["HF PL 10"] = hf_prompt_lookup
    for run in rows.values():  # untimed: warms the kernels and each policy's step costs
        run()
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    identical: dict[str, bool] = {name: True for name in rows}
    for r in range(args.rounds):
        for name, run in rows.items():
            t0 = time.process_time()
            outputs = run()
            seconds[name].append(time.process_time() - t0)
            identical[name] &= all(o[: len(ref)] == ref for o, ref in zip(outputs, reference))
        print(
            f"# round {r + 1}: " + ", ".join(f"{n} {s[-1]:.2f}s" for n, s in seconds.items()),
            file=sys.stderr,
            flush=True,
        )

    med = {name: statistics.median(s) for name, s in seconds.items()}
    print(
        f"# {args.set}: {len(prompts)} prompts, {sum(map(len, reference))} output tokens, batch {args.batch}, "
        f"{args.threads} thread(s), CPU seconds, medians of {args.rounds} interleaved rounds"
    )
    base = "HF PL 10" if "HF PL 10" in med else None
    print("| row | seconds | vs none |" + (" vs HF PL |" if base else "") + " output = none's |")
    print("|---|---|---|" + ("---|" if base else "") + "---|")
    for name, s in med.items():
        vs_base = f" {med[base] / s:.2f}x |" if base else ""
        print(f"| {name} | {s:.2f} | {med['none'] / s:.2f}x |{vs_base} {'yes' if identical[name] else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
