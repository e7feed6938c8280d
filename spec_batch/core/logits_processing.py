"""OpenAI's logit_bias, frequency_penalty and presence_penalty, at every verify position.

A penalty depends on the output so far, so under speculation each verify position must see the tokens before it:
the row's output tokens, then the draft tokens that precede that position (position j of a step follows draft
tokens 0..j-1). Accepting draft token j means the target's token there was chosen from exactly the distribution
plain decoding would have had after those same tokens, so speculation stays exact, greedy and sampled alike.

    logits[t] += logit_bias[t] - count(t) * frequency_penalty - (count(t) > 0) * presence_penalty

where count(t) counts t among the OUTPUT tokens before the position (never the prompt), as OpenAI documents it.
Both are applied before the grammar's mask (a forbidden token stays forbidden whatever its bias) and before
temperature, top-k and top-p (core/sampling.py). A draft model's distributions are shaped by the same function
(`shape_next`), so target and draft see the same rules.

Rows are anything with `tokens`, `n_generated` (the output is the last n_generated tokens) and `params`: the
decoder's rows and the drafters' views of them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def output_tokens(row: Any) -> list[int]:
    """The row's output tokens so far (a grammar's forced chain included when the row is a view with one)."""
    n = row.n_generated
    return list(row.tokens[len(row.tokens) - n :]) if n > 0 else []


def shape_logits(
    logits: torch.Tensor,  # [B, n, V] the target's logits for a step's verify positions
    rows: Sequence[Any],
    drafts: Sequence[Sequence[int]],  # per row, the step's draft tokens (position j follows drafts[b][:j])
) -> torch.Tensor:
    """The logits with each row's bias and penalties applied (a float32 copy), or the same tensor when no row has
    any. Positions past a row's draft + 1 are padding and left as they are."""
    shaped = [b for b, row in enumerate(rows) if row.params.shapes_logits]
    if not shaped:
        return logits
    logits = logits.to(torch.float32, copy=True)  # the caller's tensor stays; penalties are not rounded to bf16
    for b in shaped:
        n = min(logits.shape[1], len(drafts[b]) + 1)
        logits[b, :n] = _shaped(logits[b, :n], rows[b].params, output_tokens(rows[b]), list(drafts[b][: n - 1]))
    return logits


def shape_next(
    logits: torch.Tensor,  # [B, V] a draft model's logits for the next draft position
    rows: Sequence[Any],
    drafted: Sequence[Sequence[int]],  # per row, the draft tokens already proposed this step (before the position)
) -> torch.Tensor:
    """The draft's next-token logits shaped exactly as the target's will be at the same position."""
    shaped = [b for b, row in enumerate(rows) if row.params.shapes_logits]
    if not shaped:
        return logits
    logits = logits.to(torch.float32, copy=True)
    for b in shaped:
        history = output_tokens(rows[b]) + list(drafted[b])
        logits[b] = _shaped(logits[b].unsqueeze(0), rows[b].params, history, [])[0]
    return logits


def _shaped(logits: torch.Tensor, params: Any, history: list[int], draft: list[int]) -> torch.Tensor:
    """logits [n, V]: position j counts history + draft[:j] (len(draft) == n - 1)."""
    n, vocab = logits.shape
    device = logits.device
    out = logits
    if params.logit_bias:
        bias = torch.zeros(vocab, dtype=logits.dtype, device=device)
        ids = [t for t in params.logit_bias if t < vocab]
        bias[torch.tensor(ids, dtype=torch.long, device=device)] = torch.tensor(
            [params.logit_bias[t] for t in ids], dtype=logits.dtype, device=device
        )
        out = out + bias
    if params.frequency_penalty or params.presence_penalty:
        counts = _position_counts(history, draft, n, vocab, device).to(logits.dtype)  # [n, V]
        out = out - counts * params.frequency_penalty - (counts > 0).to(logits.dtype) * params.presence_penalty
    return out


def _position_counts(history: list[int], draft: list[int], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """counts[j, t] = occurrences of t in history + draft[:j], for j in 0..n-1. Returns [n, V] (int64)."""
    base = torch.zeros(vocab, dtype=torch.long, device=device)
    if history:
        base += torch.bincount(torch.tensor(history, dtype=torch.long, device=device), minlength=vocab)[:vocab]
    steps = torch.zeros((n, vocab), dtype=torch.long, device=device)
    if n > 1:
        steps[torch.arange(1, n, device=device), torch.tensor(draft[: n - 1], dtype=torch.long, device=device)] = 1
    return base.unsqueeze(0) + steps.cumsum(dim=0)
