"""The grammar's part of one decoding step (structured output), for the rows that have a response_format.

1. `GrammarStep(rows, force)`: each constrained (and speculating) row's chain of forced tokens (each the only token its grammar
   allows) is pushed onto its matcher. The drafter sees `views`: rows that already end with their chain, so
   it proposes what comes after it; `room` is how many tokens each row can still take as a draft.
2. `extend(draft)`: each row's draft becomes chain + the drafter's tokens, cut at the first token the
   grammar forbids (it could never be accepted); a draft model's distributions get one-hot rows in front for
   the chain. Forced tokens have constrained probability 1, so they are accepted with certainty, greedy or
   sampled, and need no special case in the verifier.
3. `mask(logits)`: every verify position gets the mask of its own prefix.
4. `settle(accepted, next_tokens)`: matchers roll back to the accepted prefix and take the target's token.
Rows without a grammar pass through unchanged (their view is the row itself; no masks, no chain).

A row whose grammar engine fails anywhere in the step (`failures`) verifies nothing of its own: its chain and draft
are dropped, its masks allow everything, and the decoder ends it with the failure instead of appending its tokens.
The other rows' drafts, masks and tokens are what they would be without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..drafting.drafters import Draft
from ..structured.grammar import GrammarState, grammar_engine, mask_logits


class ForcedView:
    """A row as the drafter should see it this step: its tokens followed by its forced chain."""

    def __init__(self, row: Any, forced: list[int]):
        self._row = row
        self.tokens = row.tokens + forced
        self.n_generated = row.n_generated + len(forced)

    def __getattr__(self, name: str) -> Any:  # params, seed, grammar, index, ...: the row's own
        return getattr(self._row, name)


class GrammarStep:
    def __init__(self, rows: Sequence[Any], force: Sequence[bool]):
        """force[b] False (plain decoding: the `none` drafter, a plain row) computes no forced chain for row b."""
        self.states: list[GrammarState | None] = [getattr(r, "grammar", None) for r in rows]
        self.active = any(s is not None for s in self.states)
        self.forced: list[list[int]] = [[] for _ in rows]
        # a step yields accepted + 1 tokens, so drafting more than the remaining budget - 1 is waste
        room = [max(0, r.params.max_new_tokens - r.n_generated - 1) for r in rows]
        if self.active:
            for b, state in enumerate(self.states):
                if state is not None and force[b]:
                    self.forced[b] = state.forced(limit=room[b])  # [] once the engine failed
        self.views = [ForcedView(r, f) if f else r for r, f in zip(rows, self.forced)]
        # a chain that ends the output (EOS) leaves nothing to draft after it
        self.room = [
            0 if (s is not None and s.ended) else n - len(f) for s, n, f in zip(self.states, room, self.forced)
        ]

    def extend(self, draft: Draft) -> Draft:
        """The step's draft: per row, forced chain + the drafter's tokens, cut where the grammar forbids."""
        if not self.active:
            return draft
        tokens = []
        for b, (state, chain, proposed) in enumerate(zip(self.states, self.forced, draft.tokens)):
            full = chain + list(proposed)
            tokens.append(full if state is None else full[: state.speculate(full)])
            if state is not None and state.failure is not None:  # this row verifies nothing of its own
                self.forced[b], tokens[b] = [], []
        probs = draft.probs
        if probs is not None and any(self.forced):
            probs = self._with_forced_rows(probs, [len(t) for t in tokens])
        confidence = None
        if draft.confidence is not None:
            confidence = [[1.0] * len(f) + list(c) for f, c in zip(self.forced, draft.confidence)]
            confidence = [c[: len(t)] for c, t in zip(confidence, tokens)]
        return Draft(tokens=tokens, probs=probs, forwards=draft.forwards, confidence=confidence)

    def _with_forced_rows(self, probs: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[B, k, V] -> [B, k', V]: one-hot rows for each chain, then the drafter's rows."""
        batch, _, vocab = probs.shape
        out = torch.zeros((batch, max(lengths, default=0), vocab), dtype=probs.dtype, device=probs.device)
        for b, (chain, n) in enumerate(zip(self.forced, lengths)):
            f = len(chain)
            if f:
                out[b, torch.arange(min(f, n)), torch.tensor(chain[:n])] = 1.0
            if n > f:
                out[b, f:n] = probs[b, : n - f]
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Masks every verify position of the constrained rows, in place. logits [B, 1 + k, V]."""
        return mask_logits(logits, self.states) if self.active else logits

    def drafted(self, drafts: Sequence[Sequence[int]]) -> list[int]:
        """Per row, how many of the verified draft tokens came from the drafter (after the forced chain)."""
        return [len(d) - len(f) for d, f in zip(drafts, self.forced)]

    def drafter_accepted(self, accepted: Sequence[int]) -> list[int]:
        """Per row, how many of the drafter's own tokens were accepted (forced tokens always are)."""
        out = []
        for state, a, f in zip(self.states, accepted, self.forced):
            if state is not None and state.failure is not None:  # its masks allowed everything: nothing to check
                out.append(max(0, a - len(f)))
                continue
            if a < len(f):
                raise RuntimeError(f"a forced token was rejected (accepted {a} of a forced chain of {len(f)})")
            out.append(a - len(f))
        return out

    def settle(self, accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        for state, a, nxt in zip(self.states, accepted, next_tokens):
            if state is not None:
                state.settle(a, nxt)

    @property
    def failures(self) -> list[str | None]:
        """Per row, why its grammar engine gave up in this step (None: it did not, or the row has no grammar)."""
        return [None if s is None else s.failure for s in self.states]


def row_grammar(tokenizer: Any, eos_ids: Sequence[int], params: Any) -> GrammarState | None:
    """A request's matcher (None without a response_format). Raises InvalidParameterError for a grammar this
    tokenizer cannot take; the compiled grammar is cached per tokenizer, so a second request compiles nothing."""
    if params.response_format is None:
        return None
    return grammar_engine(tokenizer, eos_ids).state(params.response_format)
