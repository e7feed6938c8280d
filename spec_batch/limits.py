"""The one set of request-parameter limits at every user-facing boundary: batch lines, `spec-batch generate`,
the LangChain models and the server. They are OpenAI's, so a request OpenAI accepts is accepted here.

The core's `SamplingParams` is deliberately wider (any temperature >= 0, any int seed): it serves callers that
are not users of the OpenAI contract (tests, benches). Boundaries call `check_range` / the helpers below, which
name the field in the error.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameterError


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    low_open: bool = False  # True: low itself is not allowed

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


TEMPERATURE = Range(0.0, 2.0)
TOP_P = Range(0.0, 1.0, low_open=True)
FREQUENCY_PENALTY = Range(-2.0, 2.0)
PRESENCE_PENALTY = Range(-2.0, 2.0)
LOGIT_BIAS = Range(-100.0, 100.0)
TOP_LOGPROBS = Range(0, 20)
# OpenAI documents the seed as an integer; its API accepts a signed 64-bit value.
SEED = Range(-(2**63), 2**63 - 1)
MAX_STOP_SEQUENCES = 4
MAX_N = 128  # OpenAI's own cap on `n`


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_range(name: str, value: object, allowed: Range, *, integer: bool = False) -> None:
    """Raises InvalidParameterError naming `name` when value is not a number (an integer if asked) in range."""
    kind = "an integer" if integer else "a number"
    ok_type = is_int(value) if integer else is_number(value)
    if not ok_type or not allowed.contains(value):  # type: ignore[arg-type]
        raise InvalidParameterError(f"{name} must be {kind} in {allowed.describe()}, got {value!r}")


def check_seed(name: str, value: object) -> None:
    """A seed is None or a signed 64-bit integer (OpenAI's range)."""
    if value is not None:
        check_range(name, value, SEED, integer=True)
