"""One step's plan (core/batch/planning.py): what it asks of the drafter and what the policy learns back."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec_batch.core.batch.planning import observe_proposal, plan_step
from spec_batch.core.drafting.drafters import Draft
from spec_batch.core.params import SamplingParams
from spec_batch.core.policy import DraftPolicy, RowAcceptance


class CountingDrafter:
    """A free drafter offering the same weak proposal to every row, counting the steps that looked."""

    free, has_probs = True, False

    def __init__(self) -> None:
        self.looks = 0

    def available(self, rows, k_max: int) -> list[int]:
        self.looks += 1
        return [4] * len(rows)

    def propose(self, rows, k) -> Draft:
        return Draft(tokens=[[7] * kb for kb in k], confidence=[[0.01] * kb for kb in k])


@dataclass
class Row:
    acceptance: RowAcceptance = field(default_factory=RowAcceptance)
    params: SamplingParams = field(default_factory=SamplingParams)


class Clock:
    """A lookup costing a tenth of a plain step (a wide batch's, in Python)."""

    def start(self) -> float:
        return 0.0

    def lookup(self, started: float, rows: int) -> float:
        return 0.1


def test_a_step_that_does_not_look_leaves_the_drafter_alone_and_decodes_plainly():
    policy, drafter, rows = DraftPolicy(k_max=4), CountingDrafter(), [Row() for _ in range(8)]
    policy.costs.observe_width(8, 1, 1.0)
    policy.costs.observe_width(8, 2, 1.5)
    drafts = [plan_step(drafter, policy, rows, [4] * 8, clock=Clock())[0] for _ in range(10)]
    assert not any(any(d) for draft in drafts for d in draft.tokens)  # weak offers: plain steps throughout
    assert 2 <= drafter.looks <= 3  # the first step looks; then one step in 5 (LookupPacing.share 0.02 of 0.1)


def test_a_row_is_credited_with_what_its_draft_delivered():
    row = RowAcceptance()
    row.promise(2.0)
    observe_proposal(DraftPolicy(k_max=4), row, [5, 6, 7], None, [5, 9], accepted=1, free=True)
    assert row.promised == 0.9 + 2.0 and row.delivered == 0.9 + 1


def test_a_clock_without_lookup_still_plans_and_looks_every_step():
    """A StepClock written before `lookup` existed: nothing measures the lookups, so every step looks."""
    policy, drafter, rows = DraftPolicy(k_max=4), CountingDrafter(), [Row() for _ in range(8)]
    policy.costs.observe_width(8, 1, 1.0)
    policy.costs.observe_width(8, 2, 1.5)

    class OldClock:
        def start(self) -> float:
            return 0.0

    for _ in range(5):
        plan_step(drafter, policy, rows, [4] * 8, clock=OldClock())
    assert drafter.looks == 5
