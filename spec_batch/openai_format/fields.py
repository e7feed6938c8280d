"""One validator per request-body field, in a table. A validator takes the field's value (never None: null means
"the default") and the whole body, and returns what it sets: SamplingParams keys, or the body's own keys
(`prompt`, `model`, ...). Every error names its field (relative to the body: ``temperature``,
``messages[2].role``); the batch layer prefixes ``body.``. Ranges come from spec_batch.limits (OpenAI's)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import limits
from ..core.response_format import ResponseFormatError, parse_response_format
from ..loading.chat import MessageError, validate_messages

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BOTH = (CHAT, COMPLETIONS)

# Error codes.
INVALID_VALUE = "invalid_value"
MISSING_FIELD = "missing_field"
UNSUPPORTED_FIELD = "unsupported_field"


class BodyError(ValueError):
    """An invalid request body: `code`, the field it names (`param`, relative to the body) and the problem."""

    def __init__(self, code: str, param: str, problem: str, *, separator: str = ": ") -> None:
        super().__init__(f"{param}{separator}{problem}")
        self.code = code
        self.param = param
        self.problem = problem


def bad(param: str, problem: str) -> BodyError:
    return BodyError(INVALID_VALUE, param, problem)


Check = Callable[[Any, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class BodyField:
    name: str
    endpoints: tuple[str, ...]
    check: Check
    required: bool = False


# ---------------------------------------------------------------- validators


def _number(name: str, allowed: limits.Range, key: str | None = None, integer: bool = False) -> Check:
    def check(value: Any, body: dict[str, Any]) -> dict[str, Any]:
        ok = limits.is_int(value) if integer else limits.is_number(value) and math.isfinite(value)
        if not ok or not allowed.contains(value):
            kind = "an integer" if integer else "a number"
            raise bad(name, f"must be {kind} in {allowed.describe()}, got {value!r}")
        return {key or name: value if integer else float(value)}
    return check


def _model(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, str):
        raise bad("model", f"must be a string, got {type(value).__name__}")
    return {"model": value}


def _messages(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"prompt": validate_messages(value)}
    except MessageError as e:
        code = UNSUPPORTED_FIELD if e.unsupported_field else INVALID_VALUE
        raise BodyError(code, e.param, e.problem) from None


def _prompt(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, list):
        if not value or not all(limits.is_int(t) for t in value):
            raise bad("prompt", "must be a string or a non-empty list of token ids (one prompt per line: put "
                                "several prompts on several lines)")
        negative = next((j for j, t in enumerate(value) if t < 0), None)
        if negative is not None:
            raise bad(f"prompt[{negative}]", f"token id {value[negative]} is negative; token ids are >= 0")
    elif not isinstance(value, str) or not value:
        raise bad("prompt", "must be a non-empty string")
    return {"prompt": value}


def _max_tokens(name: str) -> Check:
    def check(value: Any, body: dict[str, Any]) -> dict[str, Any]:
        if name == "max_completion_tokens" and body.get("max_tokens") is not None:
            raise bad(name, "give max_tokens or max_completion_tokens, not both")
        if not limits.is_int(value) or value < 1:
            raise bad(name, f"must be an integer >= 1, got {value!r}")
        return {"max_new_tokens": value, "max_tokens_field": name}
    return check


def _seed(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not limits.is_int(value) or not limits.SEED.contains(value):
        raise bad("seed", f"must be an integer in {limits.SEED.describe()} (64-bit), got {value!r}")
    return {"seed": value}


def _stop(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, str):
        stops = [value]
    elif isinstance(value, list):
        stops = value
    else:
        raise bad("stop", f"must be a string or a list of strings, got {type(value).__name__}")
    most = limits.MAX_STOP_SEQUENCES
    if len(stops) > most or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be at most {most} non-empty strings, got {value!r}")
    return {"stop": stops}


def _n(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, bool) or value != 1:
        raise bad("n", f"only n=1 is supported (one line per output), got {value!r}")
    return {"n": 1}


def _response_format(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"response_format": parse_response_format(value)}
    except ResponseFormatError as e:  # the engine's wording, field first: "response_format.pattern must ..."
        raise BodyError(INVALID_VALUE, e.field, e.problem, separator=" ") from None


# The table, in validation order (the first problem of a body is the one reported). The order is also the
# order of the "supported" list in an unsupported-field error.
FIELDS: tuple[BodyField, ...] = (
    BodyField("messages", (CHAT,), _messages, required=True),
    BodyField("prompt", (COMPLETIONS,), _prompt, required=True),
    BodyField("max_completion_tokens", (CHAT,), _max_tokens("max_completion_tokens")),
    BodyField("model", BOTH, _model),
    BodyField("max_tokens", BOTH, _max_tokens("max_tokens")),
    BodyField("temperature", BOTH, _number("temperature", limits.TEMPERATURE)),
    BodyField("top_p", BOTH, _number("top_p", limits.TOP_P)),
    BodyField("seed", BOTH, _seed),
    BodyField("stop", BOTH, _stop),
    BodyField("n", BOTH, _n),
    BodyField("response_format", BOTH, _response_format),
)
# The order in which fields are checked: model first, as the error a line with several problems reports.
CHECK_ORDER = ("model", "messages", "prompt", "max_completion_tokens", "max_tokens")


def fields_of(url: str) -> tuple[BodyField, ...]:
    return tuple(f for f in FIELDS if url in f.endpoints)


def checking_order(url: str) -> list[BodyField]:
    """The endpoint's fields in the order they are checked."""
    known = fields_of(url)
    first = [f for name in CHECK_ORDER for f in known if f.name == name]
    return first + [f for f in known if f not in first]
