"""What the core returns: per-request statistics, finished results and streamed chunks."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "error"]


@dataclass
class RequestStats:
    """Speculative statistics of one request (see the glossary in DESIGN.md)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0  # tokens proposed by the drafter and checked by the target
    accepted_tokens: int = 0  # draft tokens the target agreed with
    target_forwards: int = 0  # steps: target forward passes after the prefill
    draft_forwards: int = 0  # draft-model forward passes (0 for n-gram and none)
    # accepted_length_histogram[a] = number of steps in which exactly a draft tokens were accepted
    accepted_length_histogram: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / draft tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """output tokens per target forward (accepted + bonus per step)."""
        return self.output_tokens / self.target_forwards if self.target_forwards else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else None

    def record_step(self, accepted: int) -> None:
        hist = self.accepted_length_histogram
        if len(hist) <= accepted:
            hist.extend([0] * (accepted + 1 - len(hist)))
        hist[accepted] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["tokens_per_step"] = self.tokens_per_step
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass
class GenerationResult:
    """One finished request. finish_reason is "stop" (EOS or a stop string) or "length" (max_new_tokens);
    "error" only when generate(..., return_errors=True) was asked to report a failing request in place."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            "error": self.error,
        }


@dataclass
class StreamChunk:
    """The tokens accepted in one step; the last chunk carries finish_reason and stats."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
