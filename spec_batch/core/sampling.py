"""The one way logits become probabilities, and seeded per-position randomness (parameters: core/params.py).

Temperature, top-k and top-p are applied by the same function to the target's and the draft's logits, so
both distributions are shaped the same way (a trap real systems shipped as a bug).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .argmax import last_argmax
from .params import SamplingParams


def _key(seed: int, position: int, stream: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# Randomness is keyed by (request seed, output position, stream), never by step or batch slot: a seeded
# request gives the same output whatever batch it is in, however many tokens were drafted around it.
STREAM_TARGET = 0  # exponential noise that picks the target's token at a position
STREAM_ACCEPT = 1  # the uniform of the accept test at a position (draft models)
STREAM_DRAFT = 2  # exponential noise with which a draft model samples its proposal at a position


def position_generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(_key(seed, position, stream))
    return gen


def exponential_noise(seed: int, position: int, stream: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise over the vocabulary; argmax(probs / noise) is an exact sample from probs."""
    gen = position_generator(seed, position, stream, device)
    u = torch.rand(vocab, generator=gen, device=device, dtype=torch.float32)
    return (-torch.log1p(-u)).clamp_min_(1e-20)  # 1 - u in (0, 1]; the clamp keeps the division finite


def accept_uniform(seed: int, position: int, device: torch.device) -> float:
    gen = position_generator(seed, position, STREAM_ACCEPT, torch.device("cpu"))
    return float(torch.rand(1, generator=gen).item())


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential-race sampling: argmax(probs / noise) along the last dim. probs [..., vocab]."""
    return last_argmax(probs / noise)


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p), each [rows], for logits_to_probs. Greedy rows get temperature 1: their
    distribution is never sampled from (greedy verification compares argmaxes), it only has to be finite."""
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    return temperature, top_k, top_p


def logits_to_probs(
    logits: torch.Tensor,  # [rows, n, vocab]
    temperature: torch.Tensor,  # [rows], > 0
    top_k: torch.Tensor,  # [rows], 0 = off
    top_p: torch.Tensor,  # [rows], 1 = off
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF's order), then softmax. Returns float32 [rows, n, vocab]."""
    logits = logits.float() / temperature.view(-1, 1, 1)
    vocab = logits.shape[-1]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
            ranks = torch.arange(vocab, device=logits.device)
            drop |= ranks.view(1, 1, -1) >= k.view(-1, 1, 1)
        if need_p:
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
            # keep the smallest set whose mass reaches top_p; the top token always survives (before == 0 < top_p)
            drop |= before >= top_p.view(-1, 1, 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)
