"""Suffix drafting where the match is confident, the learned head elsewhere: decided per row, per step.

A templated or edited output copies long runs that the suffix index predicts for free and with high confidence;
between them (new text) the head predicts from the target's hidden states. Each step a row drafts the suffix
proposal when its first token's confidence reaches `threshold` (and it has one), else the head's chain. The head
keeps reading every row's accepted hidden states either way, so it is ready when the copy ends.

Exactness: suffix rows are one-hot drafts inside the head's probability tensor (q = 1 on the drafted token), for
which rejection sampling is the one-hot rule the verifier uses for the n-gram and suffix drafters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..drafting.drafters import Draft, DraftRow
from ..drafting.job_memory import JobMemory
from ..drafting.suffix_drafter import SuffixDrafter
from .head_drafter import HeadDrafter, NodeRate

DEFAULT_THRESHOLD = 0.5  # the suffix's calibrated-free confidence (count-based) of its first token


class HybridDrafter:
    has_probs = True
    free = False
    wants_hidden = True
    initial_acceptance = (1.0, 2.0)

    def __init__(self, head: HeadDrafter, suffix: SuffixDrafter, threshold: float = DEFAULT_THRESHOLD):
        self.head, self.suffix, self.threshold = head, suffix, threshold
        self.hidden_layers = head.hidden_layers
        self.name = f"hybrid:{head.name.removeprefix('head:')}"
        self.vocab_size = head.vocab_size
        self.suffix_steps = self.head_steps = 0  # row-steps drafted by each (for benches and tests)

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        self.head.admit(rows)
        self.suffix.admit(rows, memory)

    def observe_hidden(self, first_row: int, states: Sequence[torch.Tensor]) -> None:
        self.head.observe_hidden(first_row, states)

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        return [max(a, b) for a, b in zip(self.head.available(rows, k_max), self.suffix.available(rows, k_max))]

    def _split(
        self, rows: Sequence[DraftRow], k: Sequence[int]
    ) -> tuple[Draft, list[list[float]], list[bool], list[int]]:
        """The suffix proposal, its confidences, which rows copy it (first token's confidence >= threshold), and
        each row's length left to the head (0 for a copying row)."""
        copy = self.suffix.propose(rows, k)
        conf = copy.confidence or [[] for _ in rows]
        use_copy = [bool(t) and kb > 0 and c[0] >= self.threshold for t, c, kb in zip(copy.tokens, conf, k)]
        self.suffix_steps += sum(use_copy)
        self.head_steps += sum(1 for u, kb in zip(use_copy, k) if kb > 0 and not u)
        return copy, conf, use_copy, [0 if u else kb for u, kb in zip(use_copy, k)]

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        copy, _, use_copy, head_k = self._split(rows, k)
        learned = self.head.propose(rows, head_k)
        tokens = [c if u else h for u, c, h in zip(use_copy, copy.tokens, learned.tokens)]
        width = max((len(t) for t in tokens), default=0)
        if width == 0 or all(r.params.greedy for r in rows):  # greedy verification reads no distributions
            return Draft(tokens=tokens, forwards=learned.forwards)
        probs = torch.zeros(len(rows), width, self.vocab_size, device=self.head.device)
        if learned.probs is not None:
            probs[:, : learned.probs.shape[1]] = learned.probs[:, :width]
        for b, u in enumerate(use_copy):
            if u:
                probs[b] = 0.0
                probs[b, torch.arange(len(tokens[b])), torch.tensor(tokens[b])] = 1.0  # one-hot drafts
        return Draft(tokens=tokens, probs=probs, forwards=learned.forwards)

    def propose_tree(
        self,
        rows: Sequence[DraftRow],
        k: Sequence[int],
        width: int,
        rate: NodeRate | None = None,
        floor: float = 0.0,
        grow: Callable[[list[float]], bool] | None = None,
    ) -> Draft:
        """Trees (greedy rows at small batches: planning._plan_tree): a row whose suffix match is confident offers
        its copy as a chain of nodes (confidence: the suffix's), any other row the head's tree. Where every row
        copies the head runs no forward; it reads the waiting states at its next one."""
        copy, conf, use_copy, head_k = self._split(rows, k)
        if not any(head_k):
            learned = Draft(tokens=[[] for _ in rows], parents=[[] for _ in rows], confidence=[[] for _ in rows])
        else:
            learned = self.head.propose_tree(rows, head_k, width, rate, floor, grow)
        pick = lambda u, c, h: c if u else h
        return Draft(
            tokens=[pick(u, c, h) for u, c, h in zip(use_copy, copy.tokens, learned.tokens)],
            parents=[
                pick(u, list(range(-1, len(c) - 1)), h) for u, c, h in zip(use_copy, copy.tokens, learned.parents)
            ],  # type: ignore[arg-type]
            confidence=[pick(u, c, h) for u, c, h in zip(use_copy, conf, learned.confidence)],  # type: ignore[arg-type]
            forwards=learned.forwards,
        )

    def feedback(self, rows: Sequence[DraftRow], k: Sequence[int], accepted: Sequence[int]) -> None:
        self.head.feedback(rows, k, accepted)
        self.suffix.feedback(rows, k, accepted)

    def keep_rows(self, keep: list[int]) -> None:
        self.head.keep_rows(keep)
        self.suffix.keep_rows(keep)
