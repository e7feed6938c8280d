"""Draft trees (core/drafting/tree.py): the layout helpers, a tree forward against a chain forward of the same path, and
decoding with trees against the plain-decoding oracle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_decoder import N_NEW, PROMPTS, check_stats
from test_head_drafter import random_head

from spec_batch import SamplingParams
from spec_batch.core.calibration import FIRST_AFTER_MISS
from spec_batch.core.decoder import Decoder
from spec_batch.core.drafting.drafters import Draft
from spec_batch.core.drafting.tree import (
    TreeInput,
    ancestors,
    best_nodes,
    checked,
    depths,
    path_keep,
    path_logits,
    reaches,
    subtree,
    walk,
)
from spec_batch.core.heads.head_drafter import HeadDrafter
from spec_batch.core.kv.kv_batch import KVBatch

CPU = torch.device("cpu")

# root -> 7 (0) -> 9 (2) -> 4 (4);  root -> 5 (1) -> 6 (3)
TOKENS = [7, 5, 9, 6, 4]
PARENTS = [-1, -1, 0, 1, 2]


def test_depths_and_ancestors():
    assert depths(PARENTS) == [1, 1, 2, 2, 3]
    seen = ancestors(PARENTS, 7)  # two padded positions after the tree
    assert seen[5].nonzero().squeeze(1).tolist() == [0, 1, 3, 5]  # token 4: root, 7, 9, itself
    assert seen[4].nonzero().squeeze(1).tolist() == [0, 2, 4]  # token 6: root, 5, itself
    assert seen[6].nonzero().squeeze(1).tolist() == [6]  # padding sees itself only
    with pytest.raises(AssertionError, match="parent"):
        depths([1, -1])


def test_walk_follows_the_targets_choices_down_any_branch():
    # target's choice after each input position (root, 7, 5, 9, 6, 4)
    down_second = torch.tensor([[5, 0, 6, 0, 8, 0]])  # root -> 5 -> 6, then 8 (no such child)
    down_first = torch.tensor([[7, 9, 0, 4, 0, 3]])  # the whole first branch, then the bonus 3
    nothing = torch.tensor([[1, 0, 0, 0, 0, 0]])
    assert walk([TOKENS], [PARENTS], down_second) == ([[0, 2, 4]], [8])
    assert walk([TOKENS], [PARENTS], down_first) == ([[0, 1, 3, 5]], [3])
    assert walk([TOKENS], [PARENTS], nothing) == ([[0]], [1])


def test_path_logits_and_keep():
    logits = torch.arange(2 * 4 * 1, dtype=torch.float32).view(2, 4, 1)
    out = path_logits(logits, [[0, 2, 3], [0]])
    assert out[:, :, 0].tolist() == [[0, 2, 3], [4, 4, 4]]
    assert path_keep([[0, 2], [0]], 4, CPU).tolist() == [[True, False, True, False], [True, False, False, False]]


def test_best_nodes_keeps_ancestors_and_orders_parents_first():
    scores = [-0.1, -1.0, -0.2, -3.0, -0.2]  # node 4 ties its parent 2 (a probability of 1)
    assert best_nodes(scores, PARENTS, 3) == [0, 2, 4]
    assert best_nodes(scores, PARENTS, 4) == [0, 1, 2, 4]
    assert best_nodes(scores, PARENTS, 9) == [0, 1, 2, 3, 4]


def test_subtree_reindexes_parents():
    assert subtree(TOKENS, PARENTS, [0, 2, 4]) == ([7, 9, 4], [-1, 0, 1])
    assert subtree(TOKENS, PARENTS, [1, 3]) == ([5, 6], [-1, 0])


def test_reaches_multiply_along_the_path():
    assert reaches(PARENTS, [0.5, 0.25, 0.8, 1.0, 0.5]) == [0.5, 0.25, 0.4, 0.25, 0.2]


def test_checked_judges_every_node_whose_parent_is_on_the_emitted_path():
    # emitted 7, 9, 8: node 0 (7) and its child 2 (9) matched, their sibling 1 (5) and 4 (4, not 8) did not;
    # 3's parent (5) is off the path, so nothing is known of it
    assert checked(TOKENS, PARENTS, [7, 9, 8]) == [True, False, True, None, False]
    # one token emitted (a plain step, nothing verified): only the first level is judged
    assert checked(TOKENS, PARENTS, [5]) == [False, True, None, None, None]


def _prefilled(model, prompt: list[int]) -> KVBatch:
    kv = KVBatch(model, CPU, 1)
    kv.forward(torch.tensor([prompt[:-1]]), torch.ones(1, len(prompt) - 1, dtype=torch.bool))
    return kv


def test_a_tree_forward_gives_each_path_the_logits_and_cache_of_its_chain(tiny_target):
    prompt = [3, 17, 22, 5, 9]
    with torch.inference_mode():
        for path_nodes in ([0, 2, 4], [1, 3]):
            chain = [TOKENS[i] for i in path_nodes]
            kv_chain = _prefilled(tiny_target, prompt)
            ref = kv_chain.forward(
                torch.tensor([[prompt[-1], *chain]]), torch.ones(1, 1 + len(chain), dtype=torch.bool)
            )
            kv_tree = _prefilled(tiny_target, prompt)
            tree = TreeInput.of([PARENTS], 1 + len(TOKENS), CPU)
            ids = torch.tensor([[prompt[-1], *TOKENS]])
            out = kv_tree.forward_tree(
                ids, torch.ones_like(ids, dtype=torch.bool), kv_tree.next_pos.unsqueeze(1) + tree.depth, tree.attend
            ).logits
            positions = [[0] + [i + 1 for i in path_nodes]]
            torch.testing.assert_close(path_logits(out, positions), ref, rtol=0, atol=1e-5)
            kv_tree.keep_last(path_keep(positions, ids.shape[1], CPU))
            assert kv_tree.next_pos.tolist() == kv_chain.next_pos.tolist() == [len(prompt) + len(chain)]
            after = torch.tensor([[11]])  # the next step reads the cache the path left
            one = torch.ones(1, 1, dtype=torch.bool)
            torch.testing.assert_close(kv_tree.forward(after, one), kv_chain.forward(after, one), rtol=0, atol=1e-5)


class OracleTreeDrafter:
    """Knows each prompt's greedy continuation and hides it in a tree: at every depth a decoy sibling comes first,
    and the decoy has a child of its own, so the accepted path is never the first branch."""

    has_probs, free, initial_acceptance = False, False, (1.0, 2.0)
    name = "oracle-tree"

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int):
        self.references, self.vocab, self.trees = references, vocab, 0

    def admit(self, rows, memory=None):
        pass

    def feedback(self, rows, k, accepted):
        pass

    def keep_rows(self, keep):
        pass

    def available(self, rows, k_max):
        return [k_max] * len(rows)

    def propose(self, rows, k):
        raise AssertionError("greedy rows in a batch of at most tree_batch rows get trees")

    def propose_tree(self, rows, k, width, rate=None, floor=0.0, grow=None):
        self.trees += 1
        tokens, parents = [], []
        for row, kb in zip(rows, k):
            ref = self.references[tuple(row.tokens[: row.prompt_len])]
            truth = ref[len(row.tokens) - row.prompt_len :][:kb]
            t, p, last = [], [], -1
            for d, tok in enumerate(truth):
                t.append((tok + 1) % self.vocab)  # the decoy first
                p.append(last)
                if d == 0:
                    t.append((tok + 2) % self.vocab)  # the decoy's child
                    p.append(0)
                t.append(tok)
                p.append(last)
                last = len(t) - 1
            tokens.append(t)
            parents.append(p)
        return Draft(tokens=tokens, parents=parents, confidence=[[0.5] * len(t) for t in tokens], forwards=1)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_decoding_with_trees_equals_hf_and_accepts_the_hidden_path(tiny_target, fake_tokenizer, hf_greedy, batch_size):
    refs = {tuple(p): hf_greedy(tiny_target, p, N_NEW) for p in PROMPTS}
    drafter = OracleTreeDrafter(refs, tiny_target.config.vocab_size)
    decoder = Decoder(
        tiny_target,
        fake_tokenizer,
        target_name="tiny",
        drafter_factory=lambda drafter=drafter: drafter,
        draft_name="oracle-tree",
        device=CPU,
        max_context=512,
        num_draft_tokens=4,
        adaptive=False,
        tree_width=6,
    )  # fixed: depth 4 + 5 = all 9 nodes verified
    decoder.policy.tree_batch = batch_size
    results = decoder.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW), batch_size=batch_size)
    assert drafter.trees > 0
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == refs[tuple(prompt)]
        check_stats(res, len(prompt))
        # every step accepts its whole hidden path (4 tokens, fewer at the budget's end) and adds one
        assert res.stats.target_forwards <= -(-N_NEW // 5) + 1
        assert res.stats.draft_tokens > 2 * res.stats.accepted_tokens  # the decoys were verified too


class ChosenCosts:
    """Step costs the test chooses (the decoder's clock), so what the policy verifies does not depend on the machine's
    load: a step costs a plain step plus `per_token` of one for each token of its widest row's draft."""

    def __init__(self, per_token: float, growth: float):
        self.per_token, self.growth_cost = per_token, growth

    def start(self) -> float:
        return 0.0

    def step(self, started: float, rows: int, lengths) -> float:
        return 1.0 + self.per_token * max(lengths, default=0)

    def growth(self, started: float, forwards: int) -> float:
        return self.growth_cost

    def lookup(self, started: float, rows: int) -> float:
        return 0.0  # free: the policy looks at every step's offers


CPU_LIKE_COSTS = ChosenCosts(per_token=0.1, growth=0.2)  # a CPU's verify at batch 1: a draft token costs a tenth


class ConfidentOracle(OracleTreeDrafter):
    """States a confidence for every node: `truth` for the hidden path's nodes, `decoy` for the others (without the
    hidden path, only its decoys: a drafter whose confidence says nothing)."""

    def __init__(self, references, vocab, truth: float, decoy: float, honest: bool = True):
        super().__init__(references, vocab)
        self.truth, self.decoy, self.honest = truth, decoy, honest

    def propose_tree(self, rows, k, width, rate=None, floor=0.0, grow=None):
        draft = super().propose_tree(rows, k, width)
        tokens, parents, conf = [], [], []
        for t, p, row in zip(draft.tokens, draft.parents, rows):
            ref = self.references[tuple(row.tokens[: row.prompt_len])][len(row.tokens) - row.prompt_len :]
            on_path = [v is True for v in checked(t, p, ref)]
            below_truth: list[bool] = []  # the node or an ancestor is on the hidden path
            for i, q in enumerate(p):
                below_truth.append(on_path[i] or (q >= 0 and below_truth[q]))
            keep = [i for i in range(len(t)) if self.honest or not below_truth[i]]
            kept_t, kept_p = subtree(t, p, keep)
            tokens.append(kept_t)
            parents.append(kept_p)
            conf.append([self.truth if on_path[i] else self.decoy for i in keep])
        return Draft(tokens=tokens, parents=parents, confidence=conf, forwards=1)


def test_adaptive_trees_verify_what_calibrated_confidence_says_pays(tiny_target, fake_tokenizer, hf_greedy):
    """Adaptive: the tree is grown first and the policy verifies its nodes likeliest to be reached. An honest
    drafter's hidden path is verified and accepted; a drafter stating 0.9 for decoys only is judged on every step
    (its nodes against the emitted token, verified or not) and its calibrated rate falls (whether nodes that
    unlikely are still verified depends on what a wider step costs: test_policy's tree tests)."""
    refs = {tuple(p): hf_greedy(tiny_target, p, N_NEW) for p in PROMPTS}
    for honest in (True, False):
        drafter = ConfidentOracle(
            refs, tiny_target.config.vocab_size, truth=0.9, decoy=0.9 if not honest else 0.3, honest=honest
        )
        decoder = Decoder(
            tiny_target,
            fake_tokenizer,
            target_name="tiny",
            drafter_factory=lambda drafter=drafter: drafter,
            draft_name="oracle-tree",
            device=CPU,
            max_context=512,
            num_draft_tokens=4,
            tree_width=2,
            clock=CPU_LIKE_COSTS,
        )
        results = decoder.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW), batch_size=1)
        assert drafter.trees > 0
        for prompt, res in zip(PROMPTS, results):
            assert res.token_ids == refs[tuple(prompt)]
            check_stats(res, len(prompt))
        out = sum(r.stats.output_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        verified = sum(r.stats.draft_tokens for r in results)
        if honest:
            assert accepted > out / 2
        else:  # learned from every step's judged nodes, verified (few) or not: what 0.9 is worth here
            assert accepted == 0 and verified < out
            assert decoder.policy.calibration.rate(FIRST_AFTER_MISS, 0.9) < 0.05


def _head_drafter(target, rows, states) -> HeadDrafter:
    head = random_head(target, 48).attach(target.get_input_embeddings())
    drafter = HeadDrafter(head, "tiny", CPU, 0, target.config.vocab_size)
    drafter.admit(rows)
    drafter.observe_hidden(0, states)
    return drafter


def test_a_heads_tree_grows_each_node_as_a_chain_through_it_would(tiny_target):
    torch.manual_seed(0)
    rows = [SimpleNamespace(tokens=[3, 17, 22, 5, 9], params=SamplingParams(), seed=0, n_generated=0)]
    states = [torch.randn(4, tiny_target.config.hidden_size)]
    with torch.inference_mode():
        chain = _head_drafter(tiny_target, rows, states).propose(rows, [3]).tokens[0]
        narrow = _head_drafter(tiny_target, rows, states).propose_tree(rows, [3], 1)
        assert narrow.tokens == [chain] and narrow.parents == [[-1, 0, 1]]  # width 1 is the greedy chain
        wide = _head_drafter(tiny_target, rows, states).propose_tree(rows, [3], 3)  # every node it grew
    tokens, parents = wide.tokens[0], wide.parents[0]
    assert tokens[0] == chain[0] and parents[:3] == [-1, -1, -1]
    # fed beside its siblings, the first node's likeliest child is the chain's next token (siblings are masked)
    assert tokens[parents.index(0)] == chain[1]
    second = [i for i, p in enumerate(parents) if p == 0][0]
    assert tokens[parents.index(second)] == chain[2]


def test_after_tree_steps_the_head_reads_exactly_the_accepted_paths_states(tiny_target, fake_tokenizer):
    """Each tree's first level (its `width` likeliest first tokens) equals the top tokens of one uncached pass of the
    head over the row's real pairs: after every tree step the head's cache holds the target's states of the
    accepted path and nothing of the other branches or of its own predictions."""
    from spec_batch.loading import build_decoder

    head = random_head(tiny_target, 32, seed=5)
    dec = build_decoder(
        tiny_target,
        fake_tokenizer,
        target_name="tiny",
        draft=head,
        device=CPU,
        num_draft_tokens=3,
        adaptive=False,
        draft_weights="full",
        tree_width=3,
    )
    seen: list[tuple[list[int], list[int]]] = []
    real = HeadDrafter.propose_tree

    def spy(self, rows, k, width, **kwargs):
        draft = real(self, rows, k, width, **kwargs)
        assert draft.parents is not None
        seen.extend(
            (list(r.tokens), [t for t, p in zip(draft.tokens[b], draft.parents[b]) if p < 0])
            for b, r in enumerate(rows)
            if k[b] > 0
        )
        return draft

    HeadDrafter.propose_tree = spy
    try:
        results = dec.generate(PROMPTS, SamplingParams(max_new_tokens=12), batch_size=1)
    finally:
        HeadDrafter.propose_tree = real
    assert len(seen) > 10 and sum(r.stats.accepted_tokens for r in results) > 0
    with torch.inference_mode():
        for tokens, first_level in seen:
            ids = torch.tensor([tokens])
            states = tiny_target(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            logits = head(ids[:, 1:], states[:, :-1]).logits[0, -1]
            assert first_level == head.d2t[logits.topk(3).indices].tolist()
