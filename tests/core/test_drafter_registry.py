"""The drafter registry (core/drafting/drafter_registry.py): a drafter kind registered in a test decodes through
build_decoder with its own defaults, exactly as plain decoding does (docs/architecture.md, "Adding a drafter");
the built-in kinds keep their defaults; the capability protocols recognise the drafters that have them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from spec_batch import SamplingParams
from spec_batch.core.drafting.drafter_registry import (
    DRAFTERS,
    HEAD,
    HYBRID,
    NGRAM,
    NONE,
    SUFFIX,
    DrafterKind,
    DraftSettings,
)
from spec_batch.core.drafting.drafters import Draft, DraftRow, GrowsTrees, NgramDrafter, ReadsHidden
from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
from spec_batch.core.heads.head import head_for_target
from spec_batch.core.heads.head_drafter import HeadDrafter
from spec_batch.core.heads.hybrid_drafter import HybridDrafter
from spec_batch.errors import InvalidParameterError
from spec_batch.loading import build_decoder

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5, 4]]


class AnswerDrafter:
    """Knows each prompt's plain greedy continuation and proposes it, every third token wrong (rejections too)."""

    name = "answers"
    has_probs = False
    free = True
    initial_acceptance = (1.0, 2.0)

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int):
        self.answers, self.vocab = answers, vocab
        self.admitted = 0

    def admit(self, rows: Sequence[DraftRow], memory=None) -> None:
        self.admitted += len(rows)

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        return [k_max] * len(rows)

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        tokens = []
        for row, kb in zip(rows, k):
            prompt = tuple(row.tokens[: len(row.tokens) - row.n_generated])
            start = row.n_generated  # the row's last token is output n_generated - 1: drafts start after it
            truth = self.answers[prompt][start : start + kb]
            tokens.append([(t + 1) % self.vocab if (start + j) % 3 == 2 else t for j, t in enumerate(truth)])
        return Draft(tokens=tokens)

    def feedback(self, rows, k, accepted) -> None:
        pass

    def keep_rows(self, keep: list[int]) -> None:
        pass


def test_a_drafter_registered_in_a_test_decodes_exactly_with_its_defaults(tiny_target, fake_tokenizer):
    params = SamplingParams(max_new_tokens=24)
    plain = build_decoder(tiny_target, fake_tokenizer, target_name="tiny", draft="none", device=CPU)
    expected = plain.generate(PROMPTS, params)
    answers = {tuple(p): r.token_ids for p, r in zip(PROMPTS, expected)}
    vocab = tiny_target.get_output_embeddings().weight.shape[0]
    made: list[AnswerDrafter] = []

    def make(settings: DraftSettings):
        answer_sheet = dict(settings.options["answers"])

        def new() -> AnswerDrafter:
            made.append(AnswerDrafter(answer_sheet, vocab))
            return made[-1]

        return new

    kind = DrafterKind("answers", make=make, default_draft_tokens=5, drafts_from_memory=True, options=("answers",))
    with DRAFTERS.registered(kind):
        assert DRAFTERS.get("answers") is kind and DRAFTERS.claims("answers")
        assert DRAFTERS.listing() == '"suffix", "ngram", "none", "answers"'

        def build(**kw):
            return build_decoder(tiny_target, fake_tokenizer, target_name="tiny", draft="answers", device=CPU, **kw)

        decoder = build(drafter_options={"answers": answers}, tree_width=3)
        assert decoder.draft_name == "answers" and decoder.uses_memory
        assert decoder.policy.k_max == 5 and decoder.policy.tree_width == 1  # its defaults; it grows no trees
        got = decoder.generate(PROMPTS, params)
        assert sum(d.admitted for d in made) == len(PROMPTS)  # a drained batch starts a new drafter
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert [r.text for r in got] == [r.text for r in expected]
        assert sum(r.stats.accepted_tokens for r in got) > 0
        assert sum(r.stats.draft_tokens - r.stats.accepted_tokens for r in got) > 0  # wrong drafts were rejected
        with pytest.raises(InvalidParameterError, match=r"unknown drafter_options \['depth'\] for 'answers'"):
            build(drafter_options={"depth": 1})
        with pytest.raises(InvalidParameterError, match="options of the 'suffix' or 'answers' drafter, not of 'ngram'"):
            build_decoder(
                tiny_target, fake_tokenizer, target_name="tiny", draft="ngram", device=CPU, drafter_options={"x": 1}
            )
    assert DRAFTERS.get("answers") is None and not DRAFTERS.claims("answers")


def test_the_registry_names_kinds_whole_or_by_prefix():
    assert DRAFTERS.named() == ("suffix", "ngram", "none")
    assert DRAFTERS.get("suffix") is SUFFIX and DRAFTERS.get("ngram") is NGRAM and DRAFTERS.get("none") is NONE
    assert DRAFTERS.get("head:/some/dir") is HEAD and DRAFTERS.get("hybrid:name") is HYBRID
    assert DRAFTERS.get("self") is DRAFTERS.get("self:int8") is not None
    assert DRAFTERS.get("head") is None and DRAFTERS.claims("head")  # a bare prefix is no head, nor a model to check
    assert DRAFTERS.get("suffix:x") is None and DRAFTERS.get("HuggingFaceTB/SmolLM2-135M") is None
    assert not DRAFTERS.drafts("none") and DRAFTERS.drafts("suffix") and DRAFTERS.drafts("some/draft-model")
    with pytest.raises(ValueError, match="registered already"):
        DRAFTERS.register(DrafterKind("suffix"))
    with pytest.raises(ValueError, match="without ':'"):
        DRAFTERS.register(DrafterKind("a:b"))


def test_built_in_defaults_are_the_drafters_own():
    assert SuffixDrafter.default_draft_tokens == SUFFIX.default_draft_tokens == 16
    assert SUFFIX.options == SuffixDrafter.OPTIONS and SUFFIX.drafts_from_memory and HYBRID.drafts_from_memory
    assert HeadDrafter.default_tree_width == HEAD.default_tree_width == HYBRID.default_tree_width == 3
    assert NGRAM.default_draft_tokens == NONE.default_draft_tokens == 8 and not NONE.drafts
    assert (
        SUFFIX.tree_width(None) == SUFFIX.tree_width(4) == 1 and HEAD.tree_width(None) == 3 and HEAD.tree_width(2) == 2
    )
    with pytest.raises(InvalidParameterError, match="tree_width must be a whole number"):
        HEAD.tree_width(0)


def test_capability_protocols_recognise_the_drafters_that_have_them(tiny_target):
    head = head_for_target(tiny_target, torch.arange(64), "tiny")
    head_drafter = HeadDrafter(head, "head:tiny", CPU, 0, 64)
    hybrid = HybridDrafter(HeadDrafter(head, "head:tiny", CPU, 0, 64), SuffixDrafter())
    for drafter in (head_drafter, hybrid):
        assert isinstance(drafter, ReadsHidden) and isinstance(drafter, GrowsTrees)
    for drafter in (SuffixDrafter(), NgramDrafter(), AnswerDrafter({}, 64)):
        assert not isinstance(drafter, ReadsHidden) and not isinstance(drafter, GrowsTrees)
