"""The target's log-probabilities of each output token, read off the verify forward that already ran.

Which distribution: the target's at temperature 1 after logit_bias, the penalties (core/logits_processing.py) and a
response_format's mask (forbidden tokens have probability 0 and never appear in `top`), before temperature, top-k
and top-p. That is OpenAI's choice (logprobs do not move with temperature), and it is the same for every way a token
was produced: an accepted draft token's logprob is taken at its own verify position, the recovered or bonus
token's at the position after the accepted run, so speculative and plain decoding report the same numbers (to
float rounding: the forward runs at another width).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .outputs import TokenLogprob


def step_logprobs(
    rows: Sequence[Any],
    logits: torch.Tensor,  # [B, 1 + k, V] the logits verification read (shaped and masked)
    drafts: Sequence[Sequence[int]],
    accepted: Sequence[int],
    next_tokens: Sequence[int],
) -> list[list[TokenLogprob] | None]:
    """Per row, one TokenLogprob per token the step emitted (accepted run, then the recovered or bonus token);
    None for rows that did not ask (params.logprobs False)."""
    out: list[list[TokenLogprob] | None] = []
    for b, row in enumerate(rows):
        if not row.params.logprobs:
            out.append(None)
            continue
        emitted = list(drafts[b][: accepted[b]]) + [next_tokens[b]]
        out.append(position_logprobs(logits[b, : len(emitted)], emitted, row.params.top_logprobs))
    return out


def position_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [n, V] (position j chose tokens[j]) -> one TokenLogprob per token, with the `top` likeliest."""
    logp = logits.float().log_softmax(dim=-1)  # [n, V]
    chosen = logp[torch.arange(len(tokens), device=logp.device), torch.tensor(tokens, device=logp.device)].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top > 0:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops = [[(i, v) for i, v in zip(ri, rv) if v != float("-inf")] for ri, rv in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(tokens, chosen, tops)]
