"""Verification: which draft tokens the target accepts, and the token the target adds after them. No model calls.

Glossary (docs/architecture.md):
- draft tokens: the tokens a drafter proposed for a row this step (a row may have none).
- accepted: the leading draft tokens the target agrees with. Greedy: equal to the target's argmax. Sampled:
  each passes the rejection test (accept x with probability min(1, target_probs[x] / draft_probs[x])).
- recovered token: at the first rejected draft token, the target's correction, sampled from the residual
  normalize(max(0, target_probs - draft_probs)) (greedy: the target's argmax there). The step ends with it.
- bonus token: when every draft token was accepted (or nothing was drafted), the token sampled from the
  target's own next distribution. Every step yields accepted + 1 tokens: the run, then a recovered or bonus.

Shapes: B rows, k = longest draft in the batch (rows with shorter drafts are padded; `draft_len` says how
many of each row's k slots are real), V vocabulary. Position i of the target's outputs is the target's
distribution for the token after the i-th input, so the target has k + 1 positions for k draft tokens.

`verify_input` builds the step's target input; `verify` takes the target's logits for it (after any
masking) and runs the rules below for every row: greedy rows and one-hot drafts by matching, rows of a
drafter with distributions by rejection sampling. Randomness is keyed by (seed, output position), so a
seeded row's tokens do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .argmax import last_argmax
from .params import SamplingParams
from .sampling import (
    STREAM_TARGET,
    accept_uniform,
    exponential_noise,
    logits_to_probs,
    sample_from,
    sampling_tensors,
)


class VerifyRow(Protocol):
    """What the verifier reads of a row in flight."""

    params: SamplingParams
    seed: int
    n_generated: int  # output position of the first token this step produces


def verify_input(
    last_tokens: Sequence[int], drafts: Sequence[Sequence[int]], placeholder_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input for one step: each row's last token, then its draft tokens, placeholders after.
    Returns ids [B, 1 + k] and valid [B, 1 + k] (True on real tokens)."""
    assert len(last_tokens) == len(drafts), f"{len(last_tokens)} rows but {len(drafts)} drafts"
    width = 1 + max((len(d) for d in drafts), default=0)
    ids = torch.tensor(
        [[t, *d] + [placeholder_id] * (width - 1 - len(d)) for t, d in zip(last_tokens, drafts)], dtype=torch.long
    ).view(len(drafts), width)
    lengths = torch.tensor([1 + len(d) for d in drafts], dtype=torch.long)
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return ids.to(device), valid.to(device)


def verify(
    rows: Sequence[VerifyRow],
    drafts: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,  # [B, >= k, V] the draft's (processed) distributions, or None: one-hot drafts
    logits: torch.Tensor,  # [B, k + 1, V] the target's logits for verify_input's ids
    placeholder_id: int,
) -> tuple[list[int], list[int]]:
    """Accepted length and the token after the accepted run (recovered or bonus) for every row."""
    batch = len(rows)
    k = max((len(d) for d in drafts), default=0)
    assert len(drafts) == batch, f"{batch} rows but {len(drafts)} drafts"
    assert logits.dim() == 3 and logits.shape[:2] == (batch, k + 1), (
        f"logits {tuple(logits.shape)}: expected [{batch} rows, {k + 1} = longest draft + 1, vocab]"
    )
    vocab = logits.shape[-1]
    if draft_probs is not None:
        assert draft_probs.dim() == 3 and draft_probs.shape[0] == batch and draft_probs.shape[1] >= k, (
            f"draft_probs {tuple(draft_probs.shape)}: expected [{batch} rows, >= {k} draft positions, {vocab}]"
        )
        assert draft_probs.shape[2] == vocab, f"draft_probs vocab {draft_probs.shape[2]} != target logits vocab {vocab}"
    if k == 0 and all(r.params.greedy for r in rows):  # plain greedy decoding: each row's argmax, nothing to check
        return [0] * batch, last_argmax(logits[:, 0]).tolist()
    device = logits.device
    draft_tokens = torch.tensor(
        [list(d) + [placeholder_id] * (k - len(d)) for d in drafts], dtype=torch.long, device=device
    ).view(batch, k)
    draft_len = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    target_tokens = last_argmax(logits)  # [B, k + 1]: greedy rows are done here
    sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
    rejection = [b for b in sampled if draft_probs is not None and drafts[b]]
    one_hot = [b for b in sampled if b not in set(rejection)]
    if one_hot:
        idx = torch.tensor(one_hot, device=device)
        orows = [rows[b] for b in one_hot]
        noise = _noise(orows, [len(drafts[b]) + 1 for b in one_hot], k + 1, vocab, device)
        target_tokens[idx] = sample_from(_probs(orows, logits[idx]), noise)
    accepted = accept_matching(draft_tokens, draft_len, target_tokens)
    next_tokens = target_tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
    if rejection:
        assert draft_probs is not None
        idx = torch.tensor(rejection, device=device)
        rrows = [rows[b] for b in rejection]
        uniforms = torch.tensor(
            [[accept_uniform(r.seed, r.n_generated + j, device) for j in range(k)] for r in rrows], device=device
        ).view(len(rrows), k)
        noise = _noise(rrows, [len(drafts[b]) + 1 for b in rejection], k + 1, vocab, device)
        acc_r, next_r = accept_rejection_sampling(
            draft_tokens[idx], draft_len[idx], draft_probs[idx][:, :k], _probs(rrows, logits[idx]), uniforms, noise
        )
        accepted[idx] = acc_r
        next_tokens[idx] = next_r
    return accepted.tolist(), next_tokens.tolist()


def _probs(rows: Sequence[VerifyRow], logits: torch.Tensor) -> torch.Tensor:
    """The target's processed distributions [R, n, V] (the rows' temperature, top-k, top-p)."""
    return logits_to_probs(logits, *sampling_tensors([r.params for r in rows], logits.device))


def _noise(rows: Sequence[VerifyRow], needed: list[int], width: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, width, V] keyed by (seed, output position); ones where a position is not needed."""
    out = torch.ones((len(rows), width, vocab), device=device)
    for i, (row, n) in enumerate(zip(rows, needed)):
        for j in range(n):
            out[i, j] = exponential_noise(row.seed, row.n_generated + j, STREAM_TARGET, vocab, device)
    return out


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Length of the run of True at the start of each row. ok [B, k] -> [B]."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def _real_slots(draft_len: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=draft_len.device).unsqueeze(0) < draft_len.unsqueeze(1)  # [B, k]


def accept_matching(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_len: torch.Tensor,  # [B]
    target_tokens: torch.Tensor,  # [B, k + 1] the target's own choice at every position
) -> torch.Tensor:
    """Accepted length per row for drafts without a distribution (n-gram, or any draft under greedy).

    A draft token is accepted while it equals the target's choice; the token after the accepted run is
    target_tokens[row, accepted] (the correction at a mismatch, or the bonus after a full match). With the
    target's choice = argmax this is greedy verification; with the target's choice = an exponential-race sample
    from target_probs it is exactly rejection sampling for a one-hot draft: a draft token x is accepted with
    probability target_probs[x], and on rejection the token is distributed as target_probs without x,
    normalized, which is normalize(max(0, target_probs - one_hot(x))).
    """
    k = draft_tokens.shape[1]
    if k == 0:
        return torch.zeros(draft_tokens.shape[0], dtype=torch.long, device=draft_tokens.device)
    ok = (draft_tokens == target_tokens[:, :k]) & _real_slots(draft_len, k)
    return _leading_true(ok)


def accept_rejection_sampling(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_len: torch.Tensor,  # [B]
    draft_probs: torch.Tensor,  # [B, k, V] the draft's (processed) distribution at each draft position
    target_probs: torch.Tensor,  # [B, k + 1, V] the target's (processed) distribution
    uniforms: torch.Tensor,  # [B, k] U(0, 1) for the accept tests
    noise: torch.Tensor,  # [B, k + 1, V] Exp(1) noise for the token after the accepted run
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. 2022 / Chen et al. 2023. Returns (accepted [B], next_token [B]).

    Accept draft token x with probability min(1, target_probs[x] / draft_probs[x]); at the first rejection
    sample from normalize(max(0, target_probs - draft_probs)) and stop; if all real draft tokens are accepted,
    sample the bonus from the target's next distribution.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    if k > 0:
        idx = draft_tokens.unsqueeze(-1)
        target_at_draft = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
        draft_at_draft = draft_probs.gather(-1, idx).squeeze(-1)  # [B, k]
        # u * q <= p is u <= p / q without dividing; p > 0 guards q == 0 (a token the draft could not propose)
        ok = (target_at_draft > 0) & (uniforms * draft_at_draft <= target_at_draft) & _real_slots(draft_len, k)
        accepted = _leading_true(ok)
    else:
        accepted = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
    next_target = target_probs[rows, accepted]  # [B, V]
    dist = next_target
    rejected = accepted < draft_len
    if k > 0 and bool(rejected.any()):
        next_draft = draft_probs[rows, accepted.clamp(max=k - 1)]  # [B, V]
        residual = (next_target - next_draft).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # normalize, never softmax; a zero residual (draft == target at that position) falls back to the target
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), next_target)
        dist = torch.where(rejected.unsqueeze(-1), residual, next_target)
    next_token = sample_from(dist, noise[rows, accepted])
    return accepted, next_token
