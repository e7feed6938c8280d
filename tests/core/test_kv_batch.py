"""KVBatch: rows that advance by different amounts, rollback holes, compaction, row selection and extension
all keep each row's logits equal to a fresh, unbatched forward over the row's valid tokens."""

from __future__ import annotations

import pytest
import torch

from spec_batch.core.batch.rows import fill_order
from spec_batch.core.kv.kv_batch import KVBatch, left_padded, supports_model

CPU = torch.device("cpu")
ATOL = 2e-4


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama(1, vocab=64, layers=2)


def _fresh_all_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0]


class Mirror:
    """A KVBatch plus what each row's valid tokens should be; forward() checks logits against fresh forwards."""

    def __init__(self, model, seqs: list[list[int]]):
        self.model = model
        self.kv = KVBatch(model, CPU, len(seqs))
        self.seqs: list[list[int]] = [[] for _ in seqs]
        self._append(seqs)

    def _append(self, new: list[list[int]]) -> torch.Tensor:
        """Appends new[b] to row b (ragged, left-padded), checks every real position's logits."""
        ids, valid = left_padded(new, 0, CPU)
        width = ids.shape[1]
        with torch.inference_mode():
            logits = self.kv.forward(ids, valid)
        for b, s in enumerate(new):
            if not s:
                continue
            self.seqs[b] = self.seqs[b] + list(s)
            ref = _fresh_all_logits(self.model, self.seqs[b])[-len(s) :]
            torch.testing.assert_close(logits[b, width - len(s) :], ref, atol=ATOL, rtol=1e-4)
        assert self.kv.next_pos.tolist() == [len(s) for s in self.seqs]
        return logits

    def step(self, new: list[list[int]]) -> None:
        self._append(new)

    def rollback(self, drop: list[int]) -> None:
        self.kv.rollback(torch.tensor(drop, dtype=torch.long))
        self.seqs = [s[: len(s) - d] for s, d in zip(self.seqs, drop)]
        assert self.kv.next_pos.tolist() == [len(s) for s in self.seqs]
        assert self.kv.mask.sum(1).tolist() == [len(s) for s in self.seqs]


def test_left_padded():
    ids, valid = left_padded([[1, 2, 3], [], [4]], placeholder_id=9, device=CPU)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 9], [9, 9, 4]]
    assert valid.tolist() == [[True, True, True], [False, False, False], [False, False, True]]
    ids, valid = left_padded([[], []], placeholder_id=0, device=CPU)  # nothing to add: still one column
    assert ids.tolist() == [[0], [0]] and valid.tolist() == [[False], [False]]


def test_single_row_rollback_equals_fresh_forward(model):
    m = Mirror(model, [[3, 1, 4, 1, 5, 9, 2, 6]])
    m.step([[5, 3, 5, 8]])  # a 4-token "draft"
    m.rollback([3])  # keep one
    m.step([[11]])  # the next forward sees only the kept tokens
    m.step([[7, 7, 7]])
    m.rollback([3])
    m.step([[1, 2]])


def test_rows_with_different_lengths_and_rollbacks(model):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (9, 1, 4, 15)]
    m = Mirror(model, seqs)
    for step in range(6):
        widths = [1 + (step + b) % 4 for b in range(4)]
        new = [torch.randint(0, 64, (w,), generator=gen).tolist() for w in widths]
        m.step(new)
        m.rollback([(w - 1 + b) % w for b, w in enumerate(widths)])  # different per row, 0 included
    m.step([[1], [2], [3], [4]])


def test_rows_that_append_nothing_this_step(model):
    m = Mirror(model, [[1, 2, 3], [4, 5]])
    m.step([[6, 7], []])
    m.step([[], [8]])
    m.rollback([1, 0])
    m.step([[9], [10, 11]])


def test_holes_are_compacted_and_logits_stay_equal(model):
    """Row 1 keeps one token of every 5 (holes); when the long row 0 leaves, the holes are squeezed out."""
    gen = torch.Generator().manual_seed(1)
    m = Mirror(model, [torch.randint(0, 64, (70,), generator=gen).tolist(), [5, 6]])
    for _ in range(4):
        m.step([torch.randint(0, 64, (5,), generator=gen).tolist() for _ in range(2)])
        m.rollback([0, 4])
    assert m.kv.length >= 90
    m.kv.select_rows(torch.tensor([1]))  # row 0 finished; what is left is mostly holes
    m.seqs = [m.seqs[1]]
    assert m.kv.length <= 1.5 * len(m.seqs[0]) + 32, "select_rows did not compact"
    assert m.kv.mask.sum(1).tolist() == [len(m.seqs[0])]
    m.step([[1, 2, 3]])
    m.rollback([2])
    m.step([[4]])


def test_compaction_with_holes_in_every_row(model):
    """Rows take turns keeping a whole draft: both get holes, the cache outgrows 1.5 x the longest row + 32."""
    gen = torch.Generator().manual_seed(2)
    m = Mirror(model, [[1, 2, 3], [4, 5]])
    compacted = False
    for step in range(24):
        m.step([torch.randint(0, 64, (8,), generator=gen).tolist() for _ in range(2)])
        m.rollback([8, 0] if step % 2 else [0, 8])
        before = m.kv.length
        m.kv.maybe_compact()
        if m.kv.length < before:
            compacted = True
            m.step([[9], [10]])
    assert compacted, "the test never triggered compaction"


def test_select_rows_drops_and_reorders(model):
    m = Mirror(model, [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]])
    m.step([[1, 2], [3], [4, 5, 6], [7]])
    m.rollback([1, 0, 2, 0])
    keep = [3, 0, 2]
    m.kv.select_rows(torch.tensor(keep))
    m.seqs = [m.seqs[i] for i in keep]
    assert m.kv.batch == 3
    m.step([[12], [13, 14], [15]])
    m.rollback([0, 1, 0])
    m.step([[16], [17], [18]])


def test_rows_leaving_in_fill_order_move_only_the_rows_from_the_end(model):
    """Rows 1 and 3 of 5 leave: row 4 takes place 1 (fill_order), rows 0 and 2 stay where they are, in the same
    slabs (no new allocation), and every row's logits stay exact."""
    m = Mirror(model, [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15]])
    m.step([[1, 2], [3], [4, 5, 6], [7], [8]])
    m.rollback([1, 0, 2, 0, 0])
    slab = m.kv.cache.layers[0].room(0)[0]
    keep = fill_order([0, 2, 4])
    assert keep == [0, 4, 2]
    m.kv.select_rows(torch.tensor(keep))
    m.seqs = [m.seqs[i] for i in keep]
    assert m.kv.cache.layers[0].room(0)[0].data_ptr() == slab.data_ptr()
    m.step([[12], [13, 14], [15]])
    m.rollback([0, 1, 0])
    m.step([[16], [17], [18]])


def test_fill_order():
    assert fill_order([0, 1, 2]) == [0, 1, 2]  # nobody left
    assert fill_order([0, 1]) == [0, 1]  # the last rows left: nothing moves
    assert fill_order([1, 2, 3]) == [3, 1, 2]  # the first left: the last takes its place
    assert fill_order([0, 3, 5, 6]) == [0, 5, 6, 3]
    assert fill_order([]) == []


def test_extend_with_a_fresh_group(model):
    """A second group (prefilled separately, different cache length) joins below the first; both stay exact."""
    old = Mirror(model, [list(range(1, 12)), [20, 21]])
    old.step([[1, 2, 3], [4]])
    old.rollback([2, 0])
    new = Mirror(model, [[30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47], [50]])
    old.kv.extend(new.kv)
    old.seqs += new.seqs
    assert old.kv.batch == 4
    old.step([[5], [6], [7], [8, 9]])
    old.rollback([0, 0, 1, 1])
    old.step([[1], [2], [3], [4]])
    # and the other way round: a group with a shorter cache joins a longer one
    a = Mirror(model, [[1, 2]])
    b = Mirror(model, [list(range(30))])
    a.kv.extend(b.kv)
    a.seqs += b.seqs
    a.step([[3], [4]])


def test_a_group_joins_in_place_of_rows_that_left(model):
    """Rows 1 and 2 of 4 leave (the slabs keep their places); a group of two shorter rows joins there, into the
    same slabs, right-aligned; then one longer than the batch joins into new slabs. Every row stays exact."""
    m = Mirror(model, [list(range(1, 9)), [20, 21, 22], [23], [24, 25, 26, 27]])
    m.step([[1, 2], [3], [4, 5, 6], [7]])
    m.rollback([1, 0, 2, 0])
    slab = m.kv.cache.layers[0].room(0)[0]
    keep = fill_order([0, 3])
    m.kv.select_rows(torch.tensor(keep))
    m.seqs = [m.seqs[i] for i in keep]
    new = Mirror(model, [[30, 31, 32], [40]])
    m.kv.extend(new.kv)
    m.seqs += new.seqs
    assert m.kv.batch == 4 and m.kv.cache.layers[0].room(0)[0].data_ptr() == slab.data_ptr()
    m.step([[5], [6, 7], [8], [9]])
    m.rollback([0, 1, 0, 0])
    m.step([[1], [2], [3], [4]])
    longer = Mirror(model, [list(range(40))])
    m.kv.extend(longer.kv)  # no free rows left, and longer than the batch: new slabs
    m.seqs += longer.seqs
    assert m.kv.cache.layers[0].room(0)[0].data_ptr() != slab.data_ptr()
    m.step([[5], [6], [7], [8], [9]])


def test_extend_into_empty(model):
    empty = KVBatch(model, CPU, 0)
    group = Mirror(model, [[1, 2, 3], [4]])
    empty.extend(group.kv)
    m = Mirror.__new__(Mirror)
    m.model, m.kv, m.seqs = model, empty, group.seqs
    m.step([[5], [6]])


def test_long_sequences_grow_the_slab(model):
    """Appends past the preallocated capacity (64, doubling) keep earlier columns intact."""
    m = Mirror(model, [list(range(60))])
    for i in range(5):
        m.step([[i] * 20])
    m.rollback([30])
    m.step([[1]])


def test_supports_model(model):
    assert supports_model(model) is None

    class Cfg:
        layer_types = ["full_attention", "sliding_attention"]

    class M:
        config = Cfg()

    assert "sliding_attention" in supports_model(M())
