"""Drafters: the protocol's traits, n-gram lookup rules, and the draft model's cache (rollback, feeding the last
draft token) and distributions (shaped like the target's)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch

from spec_batch.core.drafting.drafters import Draft, ModelDrafter, NgramDrafter, NoDrafter, _NgramIndex, _to_vocab
from spec_batch.core.params import SamplingParams
from spec_batch.core.sampling import logits_to_probs

CPU = torch.device("cpu")


@dataclass
class Row:
    tokens: list[int]
    params: SamplingParams
    seed: int = 0
    n_generated: int = 0


GREEDY = SamplingParams()


# ---------------------------------------------------------------- the protocol's traits


def test_drafter_traits(tiny_llama):
    """What the loop knows of each drafter: free (no model forward: proposals are checked every step, no probing),
    distributions (rejection sampling), the prior of a new row's first-token acceptance (n-gram rows start
    skeptical: free-form text must not pay for wide verifies before a copy begins)."""
    model = ModelDrafter(tiny_llama(2, vocab=64, layers=1), "d", CPU, placeholder_id=0, vocab_size=64)
    assert (NoDrafter.free, NoDrafter.has_probs, NoDrafter.initial_acceptance) == (True, False, (1.0, 2.0))
    assert (NgramDrafter.free, NgramDrafter.has_probs, NgramDrafter.initial_acceptance) == (True, False, (0.2, 2.0))
    assert (model.free, model.has_probs, model.initial_acceptance) == (False, True, (1.0, 2.0))


def test_draft_fields():
    assert [f.name for f in fields(Draft)] == ["tokens", "probs", "forwards", "confidence", "parents"]
    assert Draft(tokens=[[1]]).confidence is None


# ---------------------------------------------------------------- n-gram


@pytest.mark.parametrize(
    "tokens,k,n_max,want",
    [
        # the suffix "2 3" occurs ending at 2 and at 6: the latest earlier one (6) wins
        ([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 3, 3, [7, 2, 3]),
        ([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 2, 3, [7, 2]),  # clamped to k
        ([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 10, 3, [7, 2, 3]),  # clamped to what exists
        # longest n first: "5 3" (n=2) ends at 1 -> [1, 3, 4, 5]; "3" alone (n=1) would give [4, 5, 3]
        ([5, 3, 1, 3, 4, 5, 3], 4, 3, [1, 3, 4, 5]),
        ([5, 3, 1, 3, 4, 5, 3], 4, 1, [4, 5, 3]),  # with n_max = 1 only unigrams
        ([1, 2, 3, 4], 3, 3, []),  # the last token never occurred before
        ([7], 3, 3, []),
        ([7, 7], 3, 3, [7]),  # overlapping continuation
        ([4, 4, 4, 4], 5, 3, [4]),  # "4 4 4" ends at 2 -> continuation is token 3
    ],
)
def test_ngram_lookup(tokens, k, n_max, want):
    assert _NgramIndex(1, n_max).lookup(tokens, k) == want


def test_ngram_min_size_is_respected():
    # with n_min = 2 a lone repeated token is not enough
    assert _NgramIndex(2, 3).lookup([1, 5, 2, 5], 3) == []
    assert _NgramIndex(2, 3).lookup([1, 5, 2, 1, 5], 3) == [2, 1, 5]


def test_ngram_index_is_incremental():
    """Looking up as the row grows gives what a fresh index gives on the whole row."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (80,), generator=gen).tolist()
    index = _NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1, 3):
        assert index.lookup(tokens[:end], 4) == _NgramIndex(1, 3).lookup(tokens[:end], 4), end


def test_ngram_drafter_rows_and_keep_rows():
    d = NgramDrafter(1, 3)
    rows = [Row([1, 2, 3, 1, 2], GREEDY), Row([9, 8, 7], GREEDY), Row([5, 6, 5], GREEDY)]
    d.admit(rows)
    assert d.available(rows, 4) == [3, 0, 2]
    draft = d.propose(rows, [2, 0, 1])
    assert draft.tokens == [[3, 1], [], [6]] and draft.probs is None and draft.forwards == 0
    assert draft.confidence is None
    d.feedback(rows, [2, 0, 1], [1, 0, 0])
    d.keep_rows([2, 0])
    rows = [rows[2], rows[0]]
    rows[1].tokens += [3, 9]
    assert d.propose(rows, [4, 4]).tokens == [[6, 5], []]


def test_ngram_sizes_are_validated():
    with pytest.raises(ValueError):
        NgramDrafter(0, 3)
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


def test_no_drafter():
    d = NoDrafter()
    rows = [Row([1, 2, 1], GREEDY)]
    d.admit(rows)
    assert d.available(rows, 8) == [0] and d.propose(rows, [0]).tokens == [[]] and not d.has_probs


# ---------------------------------------------------------------- the draft model


@pytest.fixture(scope="module")
def draft_model(tiny_llama):
    return tiny_llama(2, vocab=64, layers=1)


def _fresh_logits(model, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]  # [V]


def _fresh_probs(model, tokens, params: SamplingParams) -> torch.Tensor:
    logits = _fresh_logits(model, tokens).view(1, 1, -1)
    return logits_to_probs(
        logits, torch.tensor([params.temperature]), torch.tensor([params.top_k]), torch.tensor([params.top_p])
    )[0, 0]


def _check_next_draft(drafter, model, rows, k):
    """Proposes again and checks each drafting row's first distribution against a fresh forward of its tokens."""
    with torch.inference_mode():
        draft = drafter.propose(rows, k)
    for b, row in enumerate(rows):
        if not k[b]:
            assert draft.tokens[b] == []
        elif row.params.greedy:
            assert draft.tokens[b][0] == int(_fresh_logits(model, row.tokens).argmax())
        else:
            torch.testing.assert_close(
                draft.probs[b, 0], _fresh_probs(model, row.tokens, row.params), atol=2e-5, rtol=1e-4
            )
    return draft


def _accept(drafter, rows, draft, k, accepted, next_tokens):
    """What the decoder does after verification: feedback, then append accepted draft tokens and the next token."""
    drafter.feedback(rows, k, accepted)
    for b, row in enumerate(rows):
        row.tokens += draft.tokens[b][: accepted[b]] + [next_tokens[b]]
        row.n_generated += accepted[b] + 1


SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3)


@pytest.mark.parametrize("accepted", [3, 2, 1, 0])
def test_draft_cache_after_feedback_equals_fresh_forward(draft_model, accepted):
    """Whatever was accepted (all 3: the last draft token must be fed next time), the next proposal reads
    exactly the row's tokens."""
    d = ModelDrafter(draft_model, "d", CPU, placeholder_id=0, vocab_size=64)
    rows = [Row([3, 1, 4, 1, 5, 9, 2, 6], SAMPLED, seed=3)]
    with torch.inference_mode():
        d.admit(rows)
    draft = _check_next_draft(d, draft_model, rows, [3])
    assert len(draft.tokens[0]) == 3 and draft.probs.shape == (1, 3, 64) and draft.forwards == 3
    assert draft.confidence is None
    _accept(d, rows, draft, [3], [accepted], [60])
    draft = _check_next_draft(d, draft_model, rows, [2])
    _accept(d, rows, draft, [2], [2], [61])
    _check_next_draft(d, draft_model, rows, [1])


def test_draft_probs_follow_the_drafted_tokens(draft_model):
    """Position j of Draft.probs is the draft's distribution after the row's tokens and the first j draft tokens,
    processed with the row's temperature/top-k/top-p (like the target's); each token has probability > 0."""
    d = ModelDrafter(draft_model, "d", CPU, placeholder_id=0, vocab_size=64)
    rows = [Row([7, 7, 1, 2], SAMPLED, seed=5), Row([9], GREEDY)]
    with torch.inference_mode():
        d.admit(rows)
        draft = d.propose(rows, [4, 2])
    for b, row in enumerate(rows):
        for j, tok in enumerate(draft.tokens[b]):
            if row.params.greedy:
                assert tok == int(_fresh_logits(draft_model, row.tokens + draft.tokens[b][:j]).argmax())
            else:
                want = _fresh_probs(draft_model, row.tokens + draft.tokens[b][:j], row.params)
                torch.testing.assert_close(draft.probs[b, j], want, atol=2e-5, rtol=1e-4)
                assert draft.probs[b, j, tok] > 0
                assert int((draft.probs[b, j] > 0).sum()) <= 20  # top-k applied


def test_draft_batch_rows_with_different_k_and_acceptance(draft_model):
    d = ModelDrafter(draft_model, "d", CPU, placeholder_id=0, vocab_size=64)
    rows = [Row([1, 2, 3], SAMPLED, seed=1), Row([4, 5, 6, 7, 8, 9], GREEDY), Row([10], SAMPLED, seed=2)]
    with torch.inference_mode():
        d.admit(rows)
    k = [4, 1, 0]
    draft = _check_next_draft(d, draft_model, rows, k)
    assert [len(t) for t in draft.tokens] == k
    _accept(d, rows, draft, k, [2, 1, 0], [11, 12, 13])
    k = [2, 3, 2]
    draft = _check_next_draft(d, draft_model, rows, k)
    _accept(d, rows, draft, k, [2, 0, 1], [14, 15, 16])
    d.keep_rows([2, 0])
    rows = [rows[2], rows[0]]
    _check_next_draft(d, draft_model, rows, [3, 1])
    # a new row joins
    newcomer = [Row([20, 21, 22, 23], GREEDY)]
    with torch.inference_mode():
        d.admit(newcomer)
    rows = rows + newcomer
    draft = d.propose(rows, [0, 0, 0])
    assert draft.tokens == [[], [], []]


def test_draft_sampling_is_seeded_by_position(draft_model):
    """The same row (seed, position) drafts the same tokens whatever batch it is in."""

    def row(tokens, seed):
        return Row(tokens, SamplingParams(temperature=1.0, seed=seed), seed=seed)

    def run(rows):
        d = ModelDrafter(draft_model, "d", CPU, placeholder_id=0, vocab_size=64)
        with torch.inference_mode():
            d.admit(rows)
            return d.propose(rows, [4] * len(rows)).tokens

    alone = run([row([1, 2, 3], 42)])[0]
    assert alone == run([row([5, 6, 7, 8, 9], 7), row([1, 2, 3], 42)])[1]
    assert alone == run([row([1, 2, 3], 42), row([4], 8)])[0]
    others = [tuple(run([row([1, 2, 3], s)])[0]) for s in range(6)]
    assert len(set(others)) >= 5, f"seeds do not change the draft: {others}"


def test_to_vocab_pads_and_cuts():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(_to_vocab(logits, 2), torch.tensor([[1.0, 2.0]]))
    padded = _to_vocab(logits, 5)
    assert padded.shape == (1, 5) and torch.isneginf(padded[0, 3:]).all()
