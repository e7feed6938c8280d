"""A request's sampling parameters, validated; plain Python (no torch), so batch files and job records can be
checked and stored by processes that never decode (the CLI's submit, status and report commands).

The ranges here are deliberately wider than OpenAI's (spec_batch/limits.py, which every user-facing boundary
applies): the core rejects only what has no meaning (a negative top_k, a NaN penalty, a negative token id).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidParameterError
from .structured.response_format import ResponseFormat, parse_response_format


@dataclass
class SamplingParams:
    """A request's sampling parameters, as the core takes them. Wider on purpose than what users may ask for
    (temperature up to 100, any integer seed): tests and benches use it directly. Every user-facing boundary
    (batch lines, `spec-batch generate`, the LangChain models) checks OpenAI's ranges first (spec_batch.limits)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: fresh randomness for this request
    stop: list[str] = field(default_factory=list)
    # the shape the output must have (OpenAI's response_format; see response_format.py); None: free text.
    # Given in any accepted form (an OpenAI dict or a ResponseFormat), parsed once, here, into the ResponseFormat
    # the grammar compiles; to_dict gives it back as plain JSON for the job store
    response_format: ResponseFormat | dict[str, Any] | None = None
    # OpenAI's penalties, over the OUTPUT tokens before each position (never the prompt), applied after logit_bias:
    # logits[t] += logit_bias[t] - count(t) * frequency_penalty - (count(t) > 0) * presence_penalty
    # (core/logits_processing.py)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (keys may be "123")
    # the target's log-probability of each output token, and of the top_logprobs likeliest tokens at its position
    # (GenerationResult.logprobs; core/logprobs.py says of which distribution)
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= float(self.temperature) <= 100.0):
            raise InvalidParameterError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < float(self.top_p) <= 1.0):
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidParameterError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidParameterError(f"seed must be an integer or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidParameterError(f"stop strings must be non-empty strings, got {s!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.response_format = parse_response_format(self.response_format)  # a ResponseFormat is kept as is
        self.frequency_penalty = _finite("frequency_penalty", self.frequency_penalty)
        self.presence_penalty = _finite("presence_penalty", self.presence_penalty)
        self.logit_bias = _logit_bias(self.logit_bias)
        if not isinstance(self.logprobs, bool):
            raise InvalidParameterError(f"logprobs must be true or false, got {self.logprobs!r}")
        if (
            not isinstance(self.top_logprobs, int)
            or isinstance(self.top_logprobs, bool)
            or not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS)
        ):
            raise InvalidParameterError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidParameterError(f"top_logprobs={self.top_logprobs} needs logprobs=True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """The params as plain JSON (the job store's `params`); from_dict reads it back."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}  # JSON keys are strings
        fmt = self.response_format
        out["response_format"] = fmt.to_dict() if isinstance(fmt, ResponseFormat) else fmt
        return out

    @property
    def shapes_logits(self) -> bool:
        """True when penalties or a logit bias change the target's logits (core/logits_processing.py)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Builds params from a plain dict; an unknown key is an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidParameterError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


MAX_TOP_LOGPROBS = 1000  # wider than OpenAI's 20; a sanity cap on the per-token list


def _finite(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidParameterError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _logit_bias(bias: Any) -> dict[int, float]:
    """{token id: finite bias}; ids may come as decimal strings (JSON object keys, OpenAI's own format)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise InvalidParameterError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            token = int(key)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidParameterError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        out[token] = _finite(f"logit_bias[{key!r}]", value)
    return out


def fresh_seed() -> int:
    return secrets.randbits(63)
