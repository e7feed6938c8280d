"""What a verify step costs on this machine by the rows' draft lengths: the --padding-costs of bench_replay.py.

A batch of rows is prefilled with --context random tokens each; then forwards of random draft-length mixes (each
row reads 1 + its draft, padded on the left to the longest, as the decoder's verify step) are timed and rolled
back, in --repeats rounds over all mixes after one untimed round (median per mix). A least-squares fit gives, in
plain steps of that batch:

  T  per real draft token
  P  per padded position (a row shorter than the longest; 0 where padding is free, T where it costs as much)
  J  once any row drafts (another attention path and the padding bookkeeping)

    python -m bench.bench_step_costs                       # the default model, batch 8, context 300
    python -m bench.bench_step_costs --batch 4 --threads 1
    python -m bench.bench_replay JOB_ID --batch 8 --padding-costs T,P,J
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from bench.bench_replay import padded_step_cost
from spec_batch import load_decoder
from spec_batch.core.kv.kv_batch import KVBatch, left_padded


def mixes(batch: int, count: int, rng: random.Random) -> list[list[int]]:
    """Draft lengths per row: plain steps, every row alike, one long row, and random mixes."""
    out = [[0] * batch] * 3 + [[k] * batch for k in (1, 2, 4, 8)] + [[k] + [0] * (batch - 1) for k in (1, 4, 8, 16)]
    out += [[rng.choice([0, 0, 0, 1, 2, 4, 8, 16]) for _ in range(batch)] for _ in range(count)]
    return out


def fit(samples: list[tuple[list[int], float]]) -> tuple[float, float, float, float]:
    """(plain step seconds, T, P, J) from (draft lengths, seconds) by least squares."""
    rows = [[1.0, sum(ks), len(ks) * max(ks) - sum(ks), 1.0 if max(ks) else 0.0] for ks, _ in samples]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array([s for _, s in samples]), rcond=None)
    base = float(coef[0])
    return base, float(coef[1]) / base, float(coef[2]) / base, float(coef[3]) / base


def time_mixes(
    model,
    placeholder_id: int,
    vocab: int,
    device: torch.device,
    batch: int,
    context: int,
    plan_mixes: list[list[int]],
    repeats: int,
    seed: int = 0,
) -> list[tuple[list[int], float]]:
    """(draft lengths, median seconds) of a verify forward per mix, over `batch` rows with `context` random tokens
    cached each: one untimed round over all mixes, then `repeats` timed ones (a drift of the machine's speed
    spreads over every mix instead of biasing the ones timed first)."""
    rng = random.Random(seed)
    kv = KVBatch(model, device, 0)
    group = KVBatch(model, device, batch)
    with torch.inference_mode():
        ids = torch.randint(100, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))
        group.forward(ids.to(device), torch.ones_like(ids, dtype=torch.bool, device=device), logits_to_keep=1)
        kv.extend(group)
        plan = [(ks, [[rng.randrange(100, vocab) for _ in range(1 + k)] for k in ks]) for ks in plan_mixes]
        times: list[list[float]] = [[] for _ in plan]
        for round_ in range(repeats + 1):
            for (ks, seqs), timed in zip(plan, times):
                input_ids, valid = left_padded(seqs, placeholder_id, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                kv.forward(input_ids, valid)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    timed.append(time.perf_counter() - t0)
                kv.rollback(torch.tensor([1 + k for k in ks], device=device))
    return [(ks, statistics.median(timed)) for (ks, _), timed in zip(plan, times)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=300, help="tokens already in each row's cache")
    ap.add_argument("--mixes", type=int, default=30, help="random draft-length mixes besides the fixed ones")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds over all mixes (median per mix)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.context < 1 or args.repeats < 1:
        raise SystemExit("--batch, --context and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    decoder = load_decoder(args.target, "none", device=args.device)
    samples = time_mixes(
        decoder.target,
        decoder.placeholder_id,
        decoder.vocab_size,
        torch.device(args.device),
        args.batch,
        args.context,
        mixes(args.batch, args.mixes, random.Random(args.seed)),
        args.repeats,
        args.seed,
    )
    for ks, seconds in samples:
        print(f"  {ks}: {seconds * 1000:.1f} ms")
    base, per_token, per_pad, jump = fit(samples)
    residual = statistics.pstdev([s - base * padded_step_cost(k, per_token, per_pad, jump) for k, s in samples])
    print(
        f"\n# {args.target} on {args.device}, batch {args.batch}, context {args.context}, "
        f"{torch.get_num_threads()} thread(s): plain step {base * 1000:.1f} ms (fit residual {residual * 1000:.1f} ms)"
    )
    print(
        f"# per real draft token T = {per_token:.4f}, per padded position P = {per_pad:.4f}, once drafting J = {jump:.4f}"
    )
    print(f"--padding-costs {per_token:.4f},{per_pad:.4f},{jump:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
