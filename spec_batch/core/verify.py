"""Pure accept/reject rules for a batch of drafts. No model calls, no I/O.

Shapes: B rows, k = longest draft in the batch (rows with shorter drafts are padded; `draft_len` says how
many of each row's k slots are real), V vocabulary. Position i of the target's outputs is the target's
distribution for the token after the i-th input, so the target has k + 1 positions for k draft tokens.
"""
from __future__ import annotations

import torch

from .sampling import sample_from


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
