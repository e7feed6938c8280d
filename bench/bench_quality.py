"""How far each precision moves the default model's outputs from the full fp32 model's.

Question: per precision (full bf16, int8, int4; all from the same Q4_1 file), on a prompt set, (1) greedy agreement
with the full fp32 model: the share of outputs identical token for token, and the mean length of the common
prefix over the fp32 output's length; (2) the mean log-likelihood per token of the fp32 model's greedy outputs
under the precision's own model (teacher-forced; fp32's own value is the reference).

    .venv/bin/python -m bench.bench_quality [--sets edits,free] [--n 8] [--max-tokens 64] [--precisions full-fp32,w4a8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.precisions import PRECISIONS
from bench.prompts import SETS
from spec_batch import SamplingParams
from spec_batch.loading import load_decoder


def _mean_logprob(model, prompt: list[int], output: list[int]) -> float:
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)[torch.arange(len(output)), torch.tensor(output)]
    return float(logp.mean())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="edits,free")
    parser.add_argument("--n", type=int, default=8, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="names from bench/precisions.py; the first is the reference"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = [p for s in args.sets.split(",") for p in SETS[s][: args.n]]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    reference = None
    chosen = args.precisions.split(",")
    unknown = [name for name in chosen if name not in PRECISIONS]
    if unknown:
        parser.error(f"--precisions: unknown {unknown}; known: {', '.join(PRECISIONS)}")
    print(f"{len(texts)} prompts ({args.sets}), {args.max_tokens} tokens, greedy; reference: {chosen[0]}")
    print(f"{'precision':10s} {'identical':>9s} {'prefix':>7s} {'mean logp of fp32 outputs':>26s}")
    for name in chosen:
        weights, dtype = PRECISIONS[name]
        dec = load_decoder("default", "none", dtype=dtype, weights=weights)
        prompts = [dec.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        outputs = [r.token_ids for r in dec.generate(prompts, params, batch_size=8)]
        if reference is None:
            reference = outputs
        same = sum(o == r for o, r in zip(outputs, reference)) / len(texts)
        prefix = statistics.mean(_common_prefix(o, r) / max(1, len(r)) for o, r in zip(outputs, reference))
        logp = statistics.mean(_mean_logprob(dec.target, p, r) for p, r in zip(prompts, reference) if r)
        print(f"{name:10s} {same:9.0%} {prefix:7.0%} {logp:26.4f}", flush=True)


if __name__ == "__main__":
    main()
