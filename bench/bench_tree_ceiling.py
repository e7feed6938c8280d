"""Would a draft tree (EAGLE-2, arXiv 2406.16858) pay over the head's chain here? Its ceiling, measured.

For one generated set (bench/head_sets.py) a head is trained on --train requests (the code `drafters train`
runs); then, on --test requests it never saw, every output position is a step start: the head drafts from the
target's real states there, exactly as in decoding, and

  chain k        its greedy chain of k tokens: accepted = the run that matches the target's greedy output;
  confident t   the chain while its cumulative probability under the head stays >= t (EAGLE-2's confidence; the
                 first forward runs every step, to know whether to draft at all)
  tree N/K/D     EAGLE-2's dynamic tree: D depths (2 to --depth), at each the K frontier nodes of highest cumulative
                 probability are expanded by their K most likely tokens (one head forward of K nodes), then the
                 N nodes of highest cumulative probability are kept; accepted = the longest prefix of the
                 target's output that is a path of the tree (greedy verification).

The target's verify forward at width w (1 + drafted nodes) and the head's forward at width 1 and K are timed at
batch 1 on this machine, so each row's expected speedup over plain decoding is
(1 + accepted) / (verify(w) + draft forwards) with every time relative to one plain step. Where the best tree
wins little over the best chain, building trees in the core does not pay on this machine.

    python -m bench.bench_tree_ceiling --set free --train 100 --test 16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch

from bench.bench_heads import draft_cost
from bench.bench_step_costs import time_mixes
from bench.head_sets import MAKERS, generated_set
from spec_batch import SamplingParams, load_decoder
from spec_batch.core.heads.head import EagleHead
from spec_batch.core.heads.head_train import collect_states
from spec_batch.jobs.head_training import TrainOptions, train_from_pairs
from spec_batch.loading.heads import drafting_head

CONFIDENCES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
CONTEXT = 256  # head tokens read before a step start (the head has no use for long context)


@dataclass
class Node:
    tokens: list[int]  # target ids from the step start
    logp: float  # cumulative log-probability under the head
    features: torch.Tensor  # [len(tokens), H] the head's predicted states along the path (input of the next depth)


def _logits(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities over the target vocabulary at the last position, and the last predicted states."""
    out = head(ids, feats, logits_to_keep=1)
    logp = torch.full((ids.shape[0], head.config.vocab_size), float("-inf"))
    logp[:, head.d2t] = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
    return logp, out.features[:, -1]


def expand(
    head: EagleHead, prefix_ids: torch.Tensor, prefix_feats: torch.Tensor, nodes: list[Node | None], k: int
) -> list[Node]:
    """The k most likely children of each node (None: the root), from one head forward over all of them."""
    depth = 0 if nodes[0] is None else len(nodes[0].tokens)
    ids = prefix_ids.expand(len(nodes), -1)
    feats = prefix_feats.expand(len(nodes), -1, -1)
    if depth:
        ids = torch.cat([ids, torch.tensor([n.tokens for n in nodes])], dim=1)
        feats = torch.cat([feats, torch.stack([n.features for n in nodes])], dim=1)
    logp, new_feats = _logits(head, ids, feats)
    top = logp.topk(k, dim=-1)
    children = []
    for i, n in enumerate(nodes):
        base_tokens = [] if n is None else n.tokens
        base_logp = 0.0 if n is None else n.logp
        base_feats = prefix_feats.new_zeros(0, prefix_feats.shape[-1]) if n is None else n.features
        path_feats = torch.cat([base_feats, new_feats[i : i + 1]], dim=0)
        for lp, tok in zip(top.values[i].tolist(), top.indices[i].tolist()):
            children.append(Node(base_tokens + [tok], base_logp + lp, path_feats))
    return children


def accepted_in(tree: list[list[int]], truth: list[int]) -> int:
    paths = {tuple(t) for t in tree}
    a = 0
    while a < len(truth) and tuple(truth[: a + 1]) in paths:
        a += 1
    return a


def step_starts(
    head: EagleHead,
    ids: torch.Tensor,
    states: torch.Tensor,
    prompt_len: int,
    depth: int,
    k: int,
    budgets: list[int],
    chains: list[int],
) -> tuple[dict[str, list], int]:
    """Accepted lengths of every chain and tree at each output position of one sequence."""
    out: dict[str, list] = {f"chain {c}": [] for c in chains}
    out.update({f"tree {n}/{k}/{d}": [] for d in range(2, depth + 1) for n in budgets})
    starts = 0
    for t in range(prompt_len - 1, len(ids) - 1):  # the row's last token is ids[t]; the head read states < t
        lo = max(0, t - CONTEXT)
        prefix_ids = ids[lo + 1 : t + 1].unsqueeze(0)  # pairs (state i, token i + 1)
        prefix_feats = states[lo:t].float().unsqueeze(0)
        truth = ids[t + 1 : t + 1 + max(depth, *chains)].tolist()
        nodes: list[Node] = []
        frontier = expand(head, prefix_ids, prefix_feats, [None], k)
        nodes += frontier
        chain = [frontier[0]]
        for _ in range(max(depth, *chains) - 1):
            chain += expand(head, prefix_ids, prefix_feats, [chain[-1]], 1)
        for c in chains:
            out[f"chain {c}"].append(accepted_in([n.tokens for n in chain[:c]], truth))
        longest = max(chains)
        for tau in CONFIDENCES:  # the chain while its cumulative probability stays >= tau: (drafted, accepted)
            n = sum(1 for x in chain[:longest] if math.exp(x.logp) >= tau)
            out.setdefault(f"confident {tau}", []).append((n, accepted_in([x.tokens for x in chain[:n]], truth)))
        for _ in range(depth - 1):
            best = sorted(frontier, key=lambda n: -n.logp)[:k]
            frontier = expand(head, prefix_ids, prefix_feats, best, k)
            nodes += frontier
        for d in range(2, depth + 1):  # the nodes down to depth d are those a tree of that depth drafts
            ranked = sorted((x for x in nodes if len(x.tokens) <= d), key=lambda x: -x.logp)
            for n in budgets:
                out[f"tree {n}/{k}/{d}"].append(accepted_in([x.tokens for x in ranked[:n]], truth))
        starts += 1
    return out, starts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="free", choices=sorted(MAKERS))
    ap.add_argument("--train", type=int, default=100)
    ap.add_argument("--test", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4, help="EAGLE-2's K: nodes expanded per depth, children per node")
    ap.add_argument("--budgets", default="4,8,12,16,24", help="tree sizes N (drafted nodes)")
    ap.add_argument("--chains", default="1,2,3,4,5", help="chain lengths")
    ap.add_argument("--dtype", default=None, help="the target's compute dtype (e.g. bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    budgets = [int(x) for x in args.budgets.split(",")]
    chains = [int(x) for x in args.chains.split(",")]
    none = load_decoder("default", "none", **({"dtype": args.dtype} if args.dtype else {}))
    texts = generated_set(args.set, args.train + args.test, args.seed)
    prompts = [none.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    outputs = none.generate(prompts, params, batch_size=8)
    pairs = [(p, r.token_ids) for p, r in zip(prompts, outputs)]
    t0 = time.perf_counter()
    head = train_from_pairs(none, pairs[: args.train], TrainOptions(epochs=args.epochs, seed=args.seed)).head.float()
    print(
        f"# {args.set}: head trained on {args.train} requests in {time.perf_counter() - t0:.0f} s; "
        f"measured on {args.test} unseen ones, greedy, {args.max_new_tokens} tokens"
    )
    test = pairs[args.train :]
    examples = collect_states(none.target, [p + o for p, o in test], none.device)
    totals: dict[str, list] = {}
    n_starts = 0
    with torch.inference_mode():
        for (p, _), ex in zip(test, examples):
            acc, starts = step_starts(head, ex.ids, ex.states, len(p), args.depth, args.topk, budgets, chains)
            for name, values in acc.items():
                totals.setdefault(name, []).extend(values)
            n_starts += starts
        widths = sorted({1, *(1 + c for c in chains), *(1 + n for n in budgets)})
        vocab = none.target.get_output_embeddings().weight.shape[0]
        costs = dict(
            (ks[0] + 1, s)
            for ks, s in time_mixes(
                none.target, none.placeholder_id, vocab, none.device, 1, 200, [[w - 1] for w in widths], 7
            )
        )
        drafting = drafting_head(head, None)  # timed as it drafts (int8 on the CPU); acceptance is the float head's
        h1, hk = (draft_cost(none, drafting, CONTEXT, reps=30, width=w)["head_ms"] / 1000 for w in (1, args.topk))
    plain = costs[1]
    print(
        f"plain step {plain * 1000:.1f} ms; head forward {h1 / plain:.1%} (1 node), {hk / plain:.1%} "
        f"({args.topk} nodes) of it; {n_starts} step starts\n"
    )
    print("| draft | nodes | accepted/step | verify cost | draft cost | expected vs none |\n|---|---|---|---|---|---|")
    for name, values in totals.items():
        if name.startswith("confident"):  # per step: its own width; forwards: up to the one that said stop
            longest = max(chains)
            tokens = sum(1 + a for _, a in values)
            verify = sum(costs[1 + n] for n, _ in values) / plain
            draft = sum(min(n + 1, longest) for n, _ in values) * h1 / plain
            drafted = statistics.fmean(n for n, _ in values)
            print(
                f"| {name} | {drafted:.2f} | {statistics.fmean(a for _, a in values):.2f} | {verify / len(values):.2f} | "
                f"{draft / len(values):.2f} | {tokens / (verify + draft):.2f}x |"
            )
            continue
        acc = statistics.fmean(values)
        if name.startswith("chain"):
            n = int(name.split()[1])
            draft = n * h1
        else:
            n, _, depth = (int(x) for x in name.split()[1].split("/"))
            draft = h1 + (depth - 1) * hk
        verify = costs[1 + n] / plain
        print(
            f"| {name} | {n} | {acc:.2f} | {verify:.2f} | {draft / plain:.2f} | {(1 + acc) / (verify + draft / plain):.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
