"""A request's sampling parameters, validated; plain Python (no torch), so batch files and job records can be
checked and stored by processes that never decode (the CLI's submit, status and report commands)."""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidParameterError
from .response_format import ResponseFormat, parse_response_format


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
    # OpenAI's penalties, logit_bias (token id -> bias added to the logit) and logprobs (the target's log-probability
    # of each output token, with the `top_logprobs` likeliest): validated here; the core applies them (contract
    # in the project notes: applied at every verify position, so speculation stays exact)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
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
        self._check_openai_extras()

    def _check_openai_extras(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidParameterError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        if not isinstance(self.logit_bias, dict):
            raise InvalidParameterError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():  # keys come back as strings from JSON (the job store)
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidParameterError(f"logit_bias keys must be token ids >= 0, got {key!r}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidParameterError(f"logit_bias[{key!r}] must be a finite number, got {value!r}")
            bias[token] = float(value)
        self.logit_bias = bias
        if not isinstance(self.logprobs, bool):
            raise InvalidParameterError(f"logprobs must be true or false, got {self.logprobs!r}")
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or self.top_logprobs < 0:
            raise InvalidParameterError(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")

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

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Builds params from a plain dict; an unknown key is an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidParameterError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def fresh_seed() -> int:
    return secrets.randbits(63)
