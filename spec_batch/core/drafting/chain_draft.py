"""One chain of draft tokens, position by position, from any drafter that can give next-token logits: the rules
every drafter with a distribution shares (the target's bias and penalties, the grammar's mask, the target's
temperature / top-k / top-p, keyed draft noise, nothing after an EOS), so a draft model and a learned head cannot
drift apart in how they shape or sample what they propose."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..argmax import last_argmax
from ..logits_processing import shape_next
from ..sampling import STREAM_DRAFT, exponential_noise, logits_to_probs, sample_from, sampling_tensors
from ..structured.grammar import mask_next

# (j, ids [B, n], valid [B, n]) -> the drafter's next-token logits [B, V] over the target's vocabulary, or [B, Vd]
# over a DraftVocab. ids/valid at j = 0 are the drafter's first input (its unread tokens); then each row's last draft
# token (valid where fed).
NextLogits = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftVocab(NamedTuple):
    """A drafter's reduced vocabulary (FR-Spec, EAGLE-3's d2t): draft id i is target id d2t[i]."""

    d2t: torch.Tensor  # [Vd] long, ascending
    target_size: int

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, Vd] -> [B, V]: -inf outside the draft vocabulary (q = 0 there, and the verifier's residual
        max(0, p - q) covers those tokens, so sampling stays exact)."""
        full = logits.new_full((logits.shape[0], self.target_size), float("-inf"))
        return full.index_copy_(1, self.d2t, logits)


class Chain(NamedTuple):
    tokens: list[list[int]]  # per row, at most k[b] tokens
    # [B, k_max, V] the distributions they were drafted from; None where every row is greedy and unshaped (the
    # verifier reads draft distributions of sampled rows only, and argmaxes need no softmax over the vocabulary)
    probs: torch.Tensor | None
    forwards: int  # the drafter's forward passes


def chain_draft(
    rows: Sequence[Any],
    k: Sequence[int],
    first: tuple[torch.Tensor, torch.Tensor],
    next_logits: NextLogits,
    placeholder_id: int,
    device: torch.device,
    vocab: DraftVocab | None = None,
) -> tuple[Chain, list[int]]:
    """Up to k[b] tokens per row; returns the draft and each row's final length (shorter after an EOS under a
    grammar). The last draft token of a row is never fed (it is read by the target, and fed next step if accepted).
    vocab: next_logits speaks the drafter's reduced vocabulary."""
    batch, k = len(rows), list(k)
    k_max = max(k, default=0)
    tokens: list[list[int]] = [[] for _ in rows]
    if k_max == 0:
        return Chain(tokens, None, 0), k
    grammars = [getattr(r, "grammar", None) for r in rows]  # structured output: draft only what is allowed
    # greedy rows without bias, penalties or a grammar take the drafter's argmax as it is (per token this skips
    # the spread over the target's vocabulary and its softmax)
    plain = all(r.params.greedy and not r.params.shapes_logits and g is None for r, g in zip(rows, grammars))
    shaping = sampling_tensors([r.params for r in rows], device)
    probs_steps: list[torch.Tensor] = []
    ids, valid = first
    forwards = 0
    for j in range(k_max):
        raw = next_logits(j, ids, valid)
        forwards += 1
        if plain:
            best = last_argmax(raw)
            picked = (best if vocab is None else vocab.d2t[best]).tolist()
            picks = {b: t for b, t in enumerate(picked) if j < k[b]}
        else:
            logits = raw if vocab is None else vocab.spread(raw)
            logits = shape_next(logits, rows, tokens)  # the target's bias and penalties here
            logits = mask_next(logits, [g if j < kb else None for g, kb in zip(grammars, k)])
            probs = logits_to_probs(logits.unsqueeze(1), *shaping)[:, 0]  # [B, V]
            probs_steps.append(probs)
            picks = _pick(rows, k, j, logits, probs, device)
        next_ids = torch.full((batch, 1), placeholder_id, dtype=torch.long)
        next_valid = torch.zeros((batch, 1), dtype=torch.bool)
        for b, tok in picks.items():
            tokens[b].append(tok)
            if grammars[b] is not None:
                grammars[b].push(tok)  # allowed: drafted from the masked distribution
                if grammars[b].ended:
                    k[b] = j + 1  # nothing follows an EOS
            if j + 1 < k[b]:
                next_ids[b, 0], next_valid[b, 0] = tok, True
        if j + 1 == k_max or not bool(next_valid.any()):
            break
        ids, valid = next_ids.to(device), next_valid.to(device)
    probs_all = torch.stack(probs_steps, dim=1) if probs_steps else None
    return Chain(tokens, probs_all, forwards), k


def _pick(
    rows: Sequence[Any], k: Sequence[int], j: int, logits: torch.Tensor, probs: torch.Tensor, device: torch.device
) -> dict[int, int]:
    """Row -> its draft token at position j (rows still drafting): the argmax for greedy rows, else a sample
    from probs with the row's draft noise at this output position (independent of the target's)."""
    greedy_pick = last_argmax(logits).tolist()
    out = {}
    for b, row in enumerate(rows):
        if j >= k[b]:
            continue
        if row.params.greedy:
            out[b] = greedy_pick[b]
        else:
            noise = exponential_noise(row.seed, row.n_generated + j, STREAM_DRAFT, probs.shape[-1], device)
            out[b] = int(sample_from(probs[b], noise))
    return out
