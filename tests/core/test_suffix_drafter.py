"""The suffix drafter: per-row drafts with confidences from a row's own tokens and from the job memory, and the
job memory's token cap."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spec_batch.core.drafting.job_memory import JobMemory
from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
from spec_batch.core.params import SamplingParams


@dataclass
class Row:
    tokens: list[int]
    params: SamplingParams
    seed: int = 0
    n_generated: int = 0


def row(prompt: list[int], output: list[int] = ()) -> Row:
    return Row(list(prompt) + list(output), SamplingParams(), n_generated=len(output))


def step(drafter: SuffixDrafter, rows: list[Row], emitted: list[list[int]]) -> None:
    """What the decoder does after a step: feedback, then the rows grow."""
    drafter.feedback(rows, [0] * len(rows), [0] * len(rows))
    for r, toks in zip(rows, emitted):
        r.tokens.extend(toks)
        r.n_generated += len(toks)


DOC = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def test_rows_get_their_own_drafts_and_confidences():
    drafter = SuffixDrafter(max_spec_factor=1.0)
    copying = row(DOC + [99], [10, 11, 12, 13])  # the output copies the prompt's document
    free = row([1, 2, 3, 4], [5, 6])  # nothing repeats
    drafter.admit([copying, free])
    assert drafter.available([copying, free], 8) == [4, 0]  # 4: max_spec_factor 1.0 x match length 4
    draft = drafter.propose([copying, free], [3, 0])
    assert draft.tokens == [[14, 15, 16], []]
    assert draft.confidence == [[1.0, 1.0, 1.0], []]
    assert draft.probs is None and drafter.free and not drafter.has_probs


def test_drafts_follow_the_rows_as_they_grow():
    drafter = SuffixDrafter(max_spec_factor=4.0)
    r = row(DOC + [99], [10])
    drafter.admit([r])
    assert drafter.propose([r], [8]).tokens == [[11, 12, 13, 14]]  # match length 1, factor 4
    step(drafter, [r], [[11, 12]])
    assert drafter.propose([r], [8]).tokens == [[13, 14, 15, 16, 17, 18, 19, 99]]


def test_job_memory_offers_other_requests_outputs_and_never_an_own_trailing_occurrence():
    memory = JobMemory(max_tokens=1000)
    report = [50, 51, 52, 53, 54, 55, 56, 57]
    first = SuffixDrafter()
    a = row([1, 2], [])
    first.admit([a], memory)
    first.available([a], 8)
    step(first, [a], [report])
    first.keep_rows([])  # a finished: its whole output, last step included, is in the memory
    assert memory.index.count(report) == 1

    b = row([3, 4], [50, 51, 52])  # another request of the job starts the same way
    without = SuffixDrafter()
    without.admit([b])
    assert without.available([b], 8) == [0]
    with_memory = SuffixDrafter(max_spec_factor=1.0)
    with_memory.admit([b], memory)
    assert with_memory.available([b], 8) == [3]  # factor 1 x the match "50 51 52"
    assert with_memory.propose([b], [3]).tokens == [[53, 54, 55]]


def test_the_better_source_wins():
    memory = JobMemory(max_tokens=1000)
    memory.add([8, 9, 1, 2, 40, 41, 42, 43, 44, 45])
    drafter = SuffixDrafter(max_spec_factor=2.0)
    r = row([5, 8, 9, 20, 21, 22, 23, 0, 5, 8, 9], [])
    drafter.admit([r], memory)
    # own: "5 8 9" (3 tokens) -> 6 tokens at confidence 1; memory: "8 9" -> "1 2" only (factor 2)
    assert drafter.propose([r], [8]).tokens == [[20, 21, 22, 23, 0, 5]]
    step(drafter, [r], [[40, 41]])
    assert drafter.propose([r], [8]).tokens == [[42, 43, 44, 45]]  # own: nothing follows "41"; memory: "40 41"


def test_memory_drops_the_oldest_outputs_whole():
    memory = JobMemory(max_tokens=10)
    for start in (0, 100, 200):
        memory.add(list(range(start, start + 4)))
    assert len(memory) == 2 and memory.num_tokens == 8
    assert memory.index.count([0]) == 0 and memory.index.count([100, 101]) == 1
    key = memory.open()
    memory.extend(key, list(range(300, 320)))  # longer than the cap: the others go, the one being written stays
    assert len(memory) == 1 and memory.num_tokens == 20


def test_memory_depth_must_match():
    with pytest.raises(ValueError, match="depth"):
        SuffixDrafter(max_depth=48).admit([row([1])], JobMemory(max_depth=32))
