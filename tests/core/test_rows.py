"""A request in flight: a step's tokens join it and stop exactly at EOS, a stop string or max_new_tokens; the
statistics of a step; cancelling keeps what was produced."""

from __future__ import annotations

import pytest

from spec_batch import RequestStats, SamplingParams
from spec_batch.core.batch.rows import Row, matched_run
from spec_batch.core.policy import RowAcceptance
from spec_batch.core.text import OutputText

PROMPT = [1, 2, 3]


def _row(tokenizer, max_new_tokens: int = 10, stop=(), eos=frozenset()) -> Row:
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=list(stop))
    return Row(
        index=4,
        prompt_len=len(PROMPT),
        tokens=list(PROMPT),
        params=params,
        seed=0,
        text=OutputText(tokenizer, params.stop, eos),
        acceptance=RowAcceptance(),
        stats=RequestStats(prompt_tokens=len(PROMPT)),
    )


def test_append_until_the_budget(fake_tokenizer):
    row = _row(fake_tokenizer, max_new_tokens=5)
    assert row.append([10, 11, 12]) == [10, 11, 12] and not row.finished and row.n_generated == 3
    assert row.append([13, 14, 15]) == [13, 14]  # the 6th token is past max_new_tokens
    assert (row.finish_reason, row.output_ids, row.stats.output_tokens) == ("length", [10, 11, 12, 13, 14], 5)
    res = row.result()
    assert (res.text, res.token_ids, res.finish_reason) == ("10 11 12 13 14", [10, 11, 12, 13, 14], "length")
    assert res.stats.wall_s > 0


def test_eos_ends_the_output_and_is_counted_but_not_returned(fake_tokenizer):
    row = _row(fake_tokenizer, eos={9})
    assert row.append([10, 9, 11]) == [10]
    assert (row.finish_reason, row.output_ids, row.text.text) == ("stop", [10], "10")
    assert row.stats.output_tokens == 2 and row.n_generated == 2  # EOS counted as a generated token


def test_eos_at_the_budget_is_a_stop(fake_tokenizer):
    row = _row(fake_tokenizer, max_new_tokens=2, eos={9})
    row.append([10, 9])
    assert (row.finish_reason, row.output_ids) == ("stop", [10])


def test_stop_string_keeps_the_fewest_tokens(fake_tokenizer):
    row = _row(fake_tokenizer, stop=["11 12"])
    assert row.append([10, 11]) == [10, 11] and not row.finished
    assert row.append([12, 13, 14]) == [12]  # 13 and 14 came in the same step but after the stop string
    assert (row.finish_reason, row.output_ids, row.text.text, row.stats.output_tokens) == (
        "stop",
        [10, 11, 12],
        "10 ",
        3,
    )


def test_cancel_keeps_what_was_produced(fake_tokenizer):
    row = _row(fake_tokenizer)
    row.append([10, 11])
    row.finish("cancelled")
    res = row.result()
    assert (res.text, res.token_ids, res.finish_reason, res.stats.output_tokens) == ("10 11", [10, 11], "cancelled", 2)


def test_result_of_a_row_in_flight_is_an_error(fake_tokenizer):
    with pytest.raises(AssertionError, match="request 4 is still in flight"):
        _row(fake_tokenizer).result()


def test_record_step_counts_per_draft_position():
    st = RequestStats()
    st.record_step(drafted=3, accepted=1, draft_forwards=3)
    st.record_step(drafted=0, accepted=0, draft_forwards=0)  # nothing drafted: a step, nothing else
    st.record_step(drafted=2, accepted=2, draft_forwards=2)
    assert (st.target_forwards, st.draft_tokens, st.accepted_tokens, st.draft_forwards) == (3, 5, 3, 5)
    assert st.accepted_length_histogram == [0, 1, 1]
    assert st.drafted_per_position == [2, 2, 1] and st.accepted_per_position == [2, 1]
    d = st.to_dict()
    assert (d["drafted_per_position"], d["accepted_per_position"], d["forced_tokens"]) == ([2, 2, 1], [2, 1], 0)


@pytest.mark.parametrize(
    "proposal,emitted,want",
    [([1, 2, 3], [1, 2, 9], 2), ([1, 2], [1, 2, 3], 2), ([], [5], 0), ([4], [5], 0), ([1, 2, 3], [1], 1)],
)
def test_matched_run(proposal, emitted, want):
    assert matched_run(proposal, emitted) == want
