"""What the core returns: per-request statistics, finished results and streamed chunks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from ..errors import PromptError

FinishReason = Literal["stop", "length", "cancelled", "error"]
GRAMMAR_FAILED = "grammar_failed"  # error_code: the request's response_format failed in the grammar engine
INTERNAL_ERROR = "internal_error"  # error_code: a failure of the decoder itself, not of the request


@dataclass
class RequestStats:
    """Speculative statistics of one request (glossary: docs/architecture.md)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0  # tokens proposed by the drafter and checked by the target
    accepted_tokens: int = 0  # draft tokens the target agreed with
    target_forwards: int = 0  # steps: target forward passes after the prefill
    draft_forwards: int = 0  # draft-model forward passes (0 for n-gram and none)
    forced_tokens: int = 0  # output tokens a grammar allowed alone (structured output)
    # accepted_length_histogram[a] = number of steps in which exactly a draft tokens were accepted
    accepted_length_histogram: list[int] = field(default_factory=list)
    # drafted_per_position[j] / accepted_per_position[j] = steps in which draft position j (0-based) was
    # proposed / accepted: where along a draft the target stops agreeing
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
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

    def record_step(self, drafted: int, accepted: int, draft_forwards: int) -> None:
        """One target forward in which `drafted` draft tokens were checked and the first `accepted` accepted."""
        self.target_forwards += 1
        if drafted == 0:
            return
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.draft_forwards += draft_forwards
        _count(self.accepted_length_histogram, accepted, 1)
        _count(self.drafted_per_position, 0, drafted)
        _count(self.accepted_per_position, 0, accepted)

    def to_dict(self) -> dict:
        """The one serialisation of the statistics (batch output lines' usage.speculative, generate --json): the
        fields in order, with the rates where the output lines have always shown them."""
        out: dict = {}
        for name, value in asdict(self).items():
            out[name] = value
            if name in _RATE_AFTER:
                rate = _RATE_AFTER[name]
                out[rate] = getattr(self, rate)
        return out


# Where each rate goes in RequestStats.to_dict: after this field.
_RATE_AFTER = {"accepted_tokens": "acceptance_rate", "forced_tokens": "tokens_per_step", "wall_s": "tokens_per_s"}


def _count(counts: list[int], start: int, n: int) -> None:
    """counts[start : start + n] += 1, growing the list as needed."""
    if n <= 0:
        return
    if len(counts) < start + n:
        counts.extend([0] * (start + n - len(counts)))
    for j in range(start, start + n):
        counts[j] += 1


@dataclass
class TokenLogprob:
    """One output token's log-probability under the target, and the `top_logprobs` likeliest tokens at its position
    (most likely first; how it is computed: core/logprobs.py)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


@dataclass
class GenerationResult:
    """One finished request. finish_reason is "stop" (EOS or a stop string), "length" (max_new_tokens),
    "cancelled" (generate's should_stop said so: the text and tokens so far), or "error": a request that failed
    alone, with `error` saying why (a bad prompt when generate(..., return_errors=True) reports it in place; a
    grammar the engine gave up on while decoding, with the text so far, error_code GRAMMAR_FAILED and error_param
    "response_format"; an engine step that failed, error_code INTERNAL_ERROR)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids; None unless params.logprobs
    error_code: str | None = None  # OpenAI-style code of an error (None: the caller's own, e.g. a bad prompt)
    error_param: str | None = None  # the request field the error is about; None: not the request's fault
    # a bad prompt's error (its prompt_index and its message without the index); not part of to_dict
    prompt_error: PromptError | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            "error": self.error,
        }
        if self.logprobs is not None:  # only when asked: every other output stays as it was
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.error_code is not None:
            d["error_code"], d["error_param"] = self.error_code, self.error_param
        return d


@dataclass
class StreamChunk:
    """The tokens accepted in one step; the last chunk carries finish_reason and stats."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when params.logprobs
