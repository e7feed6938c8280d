"""bench/bench_tree_ceiling.py's bookkeeping on a tiny random head: where the target's output is the head's own
greedy chain, every chain is accepted whole, and EAGLE-2's tree (which always keeps the most likely first token)
accepts at least its first token; a tree's children are each node's most likely tokens."""

from __future__ import annotations

import itertools

import torch

from bench import bench_tree_ceiling as tc
from spec_batch.core.heads.head import head_for_target


def test_accepted_in_is_the_longest_prefix_on_a_path():
    tree = [[5], [6], [5, 7], [5, 7, 9], [6, 8]]
    assert tc.accepted_in(tree, [5, 7, 9, 1]) == 3
    assert tc.accepted_in(tree, [6, 7]) == 1
    assert tc.accepted_in(tree, [4]) == 0 and tc.accepted_in([], [5]) == 0


def test_chains_and_trees_on_the_heads_own_continuation(tiny_target):
    torch.manual_seed(0)
    head = head_for_target(tiny_target, torch.arange(0, 64, 2), "tiny").float()
    hidden = head.config.hidden_size
    prompt = torch.randint(0, 64, (8,))
    states = torch.randn(8 + 6, hidden)
    with torch.inference_mode():
        t = len(prompt) - 1
        prefix_ids, prefix_feats = prompt[1:].unsqueeze(0), states[:t].unsqueeze(0)
        children = tc.expand(head, prefix_ids, prefix_feats, [None], 3)
        logp, _ = tc._logits(head, prefix_ids, prefix_feats)
        assert [c.tokens[0] for c in children] == logp[0].topk(3).indices.tolist()
        assert all(len(c.tokens) == 1 and c.features.shape == (1, hidden) for c in children)
        chain = [children[0]]
        for _ in range(4):
            chain += tc.expand(head, prefix_ids, prefix_feats, [chain[-1]], 1)
        assert [len(c.tokens) for c in chain] == [1, 2, 3, 4, 5]
        assert all(a.logp >= b.logp for a, b in itertools.pairwise(chain))  # cumulative log-probabilities
        ids = torch.cat([prompt, torch.tensor(chain[-1].tokens)])
        out, starts = tc.step_starts(head, ids, states, len(prompt), depth=3, k=2, budgets=[4], chains=[1, 3])
    assert starts == 5
    assert out["chain 1"][0] == 1 and out["chain 3"][0] == 3  # the first start: the output is the chain itself
    assert out["tree 4/2/3"][0] >= 1 and out["tree 4/2/2"][0] >= 1
    assert all(0 <= a <= 3 for a in out["chain 3"])
    assert all(len(v) == starts for v in out.values())
    assert all(n <= 5 and a <= n for n, a in out["confident 0.1"])
