"""The suffix index against a brute-force oracle: counts, continuations, longest matches and drafts equal a
naive scan of the sequences, through interleaved appends, closes and removals. Every test runs on both tries: the
Python one and the C++ one (loading/kernels/suffix_trie.cpp, where the native kernels build)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from spec_batch.core.drafting.native_suffix_index import NativeSuffixIndex, new_suffix_index
from spec_batch.core.drafting.suffix_index import SuffixIndex
from spec_batch.loading.kernels import native_ops


@pytest.fixture(params=["python", "native"])
def make_index(request):
    """SuffixIndex(max_depth) of either implementation."""
    if request.param == "python":
        return SuffixIndex
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    make = new_suffix_index
    assert isinstance(make(2), NativeSuffixIndex)  # the drafters get the C++ trie once the kernels are loaded
    return make


# ---------------------------------------------------------------- the oracle: naive scans


def occurrences(seqs: dict[int, list[int]], w: list[int]) -> list[tuple[int, int]]:
    return [(s, p) for s, seq in seqs.items() for p in range(len(seq) - len(w) + 1) if seq[p : p + len(w)] == w]


def naive_next_counts(seqs: dict[int, list[int]], w: list[int]) -> dict[int, int]:
    return dict(Counter(seqs[s][p + len(w)] for s, p in occurrences(seqs, w) if p + len(w) < len(seqs[s])))


def naive_draft(seqs, context, depth, max_tokens, max_match, factor, min_prob):
    match = 0
    for m in range(min(max_match, len(context), depth - 1), 0, -1):
        if naive_next_counts(seqs, context[len(context) - m :]):
            match = m
            break
    w = list(context[len(context) - match :]) if match else []
    tokens, probs, alive = [], [], 1.0
    while match and len(tokens) < min(max_tokens, int(match * factor + 1e-9)) and len(w) < depth:
        counts = naive_next_counts(seqs, w)
        if not counts:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        prob = counts[token] / sum(counts.values())
        alive *= prob
        if alive < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        w.append(token)
    return match, tokens, probs


def check_against_oracle(
    index: SuffixIndex | NativeSuffixIndex, seqs: dict[int, list[int]], alphabet: int, rng: random.Random
) -> None:
    depth = index.max_depth
    for n in range(1, depth + 1):
        for w in itertools.product(range(alphabet), repeat=n):
            assert index.count(w) == len(occurrences(seqs, list(w))), w
            if n < depth:
                assert index.next_counts(w) == naive_next_counts(seqs, list(w)), w
    assert index.num_tokens == sum(len(s) for s in seqs.values())
    for _ in range(20):
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 2 * depth))]
        max_tokens, max_match = rng.randrange(1, 8), rng.randrange(1, depth + 1)
        factor, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4])
        got = index.draft(
            context, max_tokens=max_tokens, max_match=max_match, max_spec_factor=factor, min_token_prob=min_prob
        )
        want = naive_draft(seqs, context, depth, max_tokens, max_match, factor, min_prob)
        assert (got.match_len, got.tokens, got.probs) == want, context


@pytest.mark.parametrize("seed", range(12))
def test_interleaved_appends_closes_and_removals_match_a_naive_scan(seed, make_index):
    rng = random.Random(seed)
    alphabet, depth = 3, rng.choice([2, 4, 5])
    index = make_index(depth)
    seqs: dict[int, list[int]] = {}
    open_ids: list[int] = []
    next_id = 0
    for _ in range(12):
        action = rng.random()
        if action < 0.25 or not open_ids:
            open_ids.append(next_id)
            seqs[next_id] = []
            next_id += 1
        elif action < 0.35:
            sid = open_ids.pop(rng.randrange(len(open_ids)))
            index.close(sid)
        elif action < 0.45 and seqs:
            sid = rng.choice(list(seqs))
            index.remove(sid)
            del seqs[sid]
            if sid in open_ids:
                open_ids.remove(sid)
        for sid in open_ids:  # rows in flight grow side by side
            chunk = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 6))]
            index.extend(sid, chunk)
            seqs[sid].extend(chunk)
        check_against_oracle(index, seqs, alphabet, rng)


def test_a_path_of_a_row_in_flight_keeps_growing_after_another_row_catches_up_with_it(make_index):
    index = make_index(4)
    index.extend(0, [1, 2])
    index.extend(1, [1, 2])  # row 1's paths reach the ends of row 0's
    index.extend(0, [3])
    assert (index.count([1, 2, 3]), index.count([2, 3]), index.count([1, 2])) == (1, 1, 2)


def test_repeats_of_one_token_count_every_overlapping_occurrence(make_index):
    index = make_index(4)
    index.extend(0, [7] * 6)
    assert [index.count([7] * n) for n in range(1, 5)] == [6, 5, 4, 3]
    assert index.next_counts([7, 7, 7]) == {7: 3}


def test_removing_every_sequence_leaves_an_empty_trie(make_index):
    rng = random.Random(1)
    index = make_index(6)
    for sid in range(5):
        index.extend(sid, [rng.randrange(3) for _ in range(40)])
    for sid in range(5):
        index.remove(sid)
    assert index.node_count() == 1 and index.num_tokens == 0 and len(index) == 0
    assert index.count([0]) == 0


def test_text_without_repeats_costs_no_nodes(make_index):
    index = make_index(32)
    index.extend(0, range(1000))
    assert index.node_count() == 1  # every path is a tail
    index.extend(1, range(500, 520))  # a repeated span becomes nodes along its paths only
    assert index.count(range(500, 520)) == 2
    assert index.node_count() < 20 * 32 + 1


def test_the_draft_continues_the_longest_match_and_own_trailing_occurrence_does_not_count(make_index):
    index = make_index(16)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 9]
    index.extend(0, prompt + [1, 2])  # the row so far ends with "1 2"; "1 2" was followed by 3 and by 9
    draft = index.draft(prompt + [1, 2], max_tokens=8, max_match=8, max_spec_factor=4, min_token_prob=0.0)
    assert draft.match_len == 2
    assert draft.tokens[:1] == [3] and draft.probs[0] == 0.5  # 3 vs 9 tie: the smaller id; own end not counted
    index.extend(0, [3])
    draft = index.draft(prompt + [1, 2, 3], max_tokens=3, max_match=8, max_spec_factor=1.0, min_token_prob=0.0)
    assert (draft.match_len, draft.tokens, draft.probs) == (3, [4, 5, 6], [1.0, 1.0, 1.0])
    assert draft.score == 3.0


def test_closed_sequences_refuse_appends(make_index):
    index = make_index(4)
    index.extend(0, [1, 2])
    index.close(0)
    with pytest.raises(ValueError, match="closed"):
        index.extend(0, [3])


@pytest.mark.parametrize("seed", range(4))
def test_the_cpp_trie_takes_the_python_tries_steps_on_long_rows_with_removals(seed):
    """Deeper and longer than the oracle can scan: both tries hold the same nodes and give the same drafts,
    through removals whose freed nodes the C++ trie reuses."""
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    rng = random.Random(seed)
    python, native = SuffixIndex(48), new_suffix_index(48)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(3, 12))] for _ in range(8)]
    for sid in range(30):
        tokens = [t for _ in range(rng.randrange(5, 40)) for t in rng.choice(phrases + [[rng.randrange(200)]])]
        for index in (python, native):
            index.extend(sid, tokens[: len(tokens) // 2])
            index.extend(sid, tokens[len(tokens) // 2 :])
            if sid % 3:
                index.close(sid)
            if sid % 4 == 3:
                index.remove(sid - 2)
        assert (native.node_count(), native.num_tokens, len(native)) == (
            python.node_count(),
            python.num_tokens,
            len(python),
        )
        for _ in range(10):
            context = tokens[: rng.randrange(1, len(tokens) + 1)]
            options = dict(max_tokens=rng.randrange(1, 20), max_match=rng.randrange(1, 48), max_spec_factor=2.0)
            assert native.draft(context, **options) == python.draft(context, **options)
            assert native.next_counts(context[-5:]) == python.next_counts(context[-5:])
