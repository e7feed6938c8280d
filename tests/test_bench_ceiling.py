"""bench/bench_ceiling.py's oracle drafter (no model): the suffix drafter's proposal, cut to what the target accepts."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench import bench_ceiling
from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
from spec_batch.core.params import SamplingParams


@dataclass
class _Row:
    tokens: list[int]
    n_generated: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0


def test_the_oracle_cuts_each_proposal_where_the_known_output_departs_from_it():
    prompt = [3, 5, 6, 7, 8, 9, 10, 11, 2, 5, 6, 7]  # ends with a context seen before: 8 9 10 11 2 ... follows
    output = [8, 9, 10, 42]
    plain, oracle = SuffixDrafter(), bench_ceiling.OracleSuffixDrafter({tuple(prompt): output})
    for drafter in (plain, oracle):
        drafter.admit([_Row(list(prompt))])
    assert plain.available([_Row(list(prompt))], 16) == [6]  # 2 x the 3-token match: 8 9 10 11 2 5
    assert oracle.available([_Row(list(prompt))], 16) == [3]
    assert oracle.propose([_Row(list(prompt))], [3]).tokens == [[8, 9, 10]]
    # later in the output the known output is read from the row's own position: 11 2 5 ... is offered, 42 comes
    row = _Row(prompt + [8, 9, 10], n_generated=3)
    for drafter in (plain, oracle):
        drafter.keep_rows([])
        drafter.admit([row])
    assert plain.available([row], 16)[0] > 0
    assert oracle.available([row], 16) == [0]
