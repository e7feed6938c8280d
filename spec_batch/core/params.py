"""A request's sampling parameters, validated; plain Python (no torch), so batch files and job records can be
checked and stored by processes that never decode (the CLI's submit, status and report commands)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidParameterError
from .response_format import ResponseFormat, parse_response_format


@dataclass
class SamplingParams:
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """The params as plain JSON (the job store's `params`); from_dict reads it back."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
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
