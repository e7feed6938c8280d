"""One validator per request-body field, in a table. A validator takes the field's value (never None: null means
"the default") and the whole body, and returns what it sets: SamplingParams keys, or the body's own keys
(`prompt`, `model`, ...). Every error names its field (relative to the body: ``temperature``,
``messages[2].role``); the batch layer prefixes ``body.``. Ranges come from spec_batch.limits (OpenAI's)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import limits
from ..core.structured.response_format import ResponseFormatError, parse_response_format
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


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """(the field, the character) of the first string (or object key) in `value` that holds a lone UTF-16
    surrogate (JSON's "\\ud800" without its pair): such text is no Unicode, and no tokenizer, database or UTF-8
    writer takes it. None when there is none. Walks with a stack of its own: any depth."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                return at, found.group()
        elif isinstance(item, dict):
            for key, v in reversed(item.items()):
                name = f"{at}.{key}" if at else str(key)
                if _SURROGATE.search(key):
                    return name, _SURROGATE.search(key).group()  # type: ignore[union-attr]
                stack.append((name, v))
        elif isinstance(item, list):
            stack.extend((f"{at}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def check_unicode(value: Any, where: str = "") -> None:
    """Raises BodyError naming the field that holds a lone surrogate (see lone_surrogate)."""
    found = lone_surrogate(value, where)
    if found is not None:
        param, char = found
        raise bad(
            param,
            f"contains a lone surrogate (\\u{ord(char):04x}), which is not valid Unicode text: send the character "
            "itself or its full surrogate pair",
        )


Check = Callable[[Any, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class BodyField:
    name: str
    endpoints: tuple[str, ...]
    check: Check
    required: bool = False
    online_only: bool = False  # a field of HTTP requests only (stream): unsupported in a batch line


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


_PROMPT_FORMS = "a string, a list of token ids, a list of strings or a list of lists of token ids"


def _one_prompt(value: Any, where: str) -> str | list[int]:
    """One prompt: a non-empty string or a non-empty list of token ids (>= 0)."""
    if isinstance(value, str):
        if not value:
            raise bad(where, "must be a non-empty string")
        return value
    if not isinstance(value, list) or not value or not all(limits.is_int(t) for t in value):
        raise bad(where, f"must be {_PROMPT_FORMS} (each non-empty)")
    negative = next((j for j, t in enumerate(value) if t < 0), None)
    if negative is not None:
        raise bad(f"{where}[{negative}]", f"token id {value[negative]} is negative; token ids are >= 0")
    return value


def _prompt(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's four forms. One prompt (a string, token ids, or a list of one of either) is kept as that prompt;
    several are a list of strings or a list of token-id lists (prompt_list reads both): one choice per prompt and
    n, at most MAX_N choices in all."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        kinds = {type(p) for p in value}
        if len(kinds) > 1:
            raise bad("prompt", f"must be {_PROMPT_FORMS}, not a mix of strings and token-id lists")
        prompts = [_one_prompt(p, f"prompt[{k}]") for k, p in enumerate(value)]
        n = body.get("n") if limits.is_int(body.get("n")) else 1
        if len(prompts) * max(n, 1) > limits.MAX_N:
            raise bad("prompt", f"{len(prompts)} prompts x n={n} choices: at most {limits.MAX_N} choices a request")
        return {"prompt": prompts[0] if len(prompts) == 1 else prompts}
    return {"prompt": _one_prompt(value, "prompt")}


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
    if not limits.is_int(value) or not 1 <= value <= limits.MAX_N:
        raise bad("n", f"must be an integer in [1, {limits.MAX_N}], got {value!r}")
    return {"n": value}


def _logit_bias(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad("logit_bias", f"must be an object of token id -> bias, got {type(value).__name__}")
    bias: dict[int, float] = {}
    for key, b in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad("logit_bias", f'keys must be token ids as strings ("50256"), got {key!r}')
        if not limits.is_number(b) or not math.isfinite(b) or not limits.LOGIT_BIAS.contains(b):
            raise bad(f"logit_bias.{key}", f"must be a number in {limits.LOGIT_BIAS.describe()}, got {b!r}")
        bias[int(key)] = float(b)
    return {"logit_bias": bias}


def _chat_logprobs(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise bad("logprobs", f"must be true or false, got {value!r}")
    return {"logprobs": value}


def _top_logprobs(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("logprobs") is not True:
        raise bad("top_logprobs", "needs logprobs: true")
    return _number("top_logprobs", limits.TOP_LOGPROBS, integer=True)(value, body)


def _completion_logprobs(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    """/v1/completions: logprobs is the number of likeliest tokens to list per position (0: the chosen only)."""
    top = _number("logprobs", limits.TOP_LOGPROBS, key="top_logprobs", integer=True)(value, body)
    return {"logprobs": True, **top}


def _tools(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, list) or not value:
        raise bad("tools", f"must be a non-empty list of function tools, got {value!r}")
    return {"tools": value}


def _tool_choice(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    return {"tool_choice": value}  # checked against the tools once both are read (body.py)


def _recorded(name: str, kind: type | tuple[type, ...], what: str) -> Check:
    """A field accepted and recorded that changes nothing here (docs/batch-format.md lists them)."""

    def check(value: Any, body: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value, kind):
            raise bad(name, f"must be {what}, got {value!r}")
        return {RECORDED + name: value}

    return check


def _stream(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise bad("stream", f"must be true or false, got {value!r}")
    return {"stream": value}


def _metadata(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's limits: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""
    if not isinstance(value, dict) or len(value) > 16:
        raise bad("metadata", f"must be an object of at most 16 string pairs, got {value!r}"[:300])
    for key, v in value.items():
        if len(key) > 64 or not isinstance(v, str) or len(v) > 512:
            raise bad(f"metadata.{key}"[:80], "keys have at most 64 characters and values are strings of at most 512")
    return {RECORDED + "metadata": value}


def _response_format(value: Any, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"response_format": parse_response_format(value)}
    except ResponseFormatError as e:  # the engine's wording, field first: "response_format.pattern must ..."
        raise BodyError(INVALID_VALUE, e.field, e.problem, separator=" ") from None


RECORDED = "recorded."  # prefix of the values of fields that are recorded only

# The table. Its order is the "supported" list of an unsupported-field error, and the order fields are checked
# in (the first problem is the one reported), except that CHECK_ORDER's come first.
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
    BodyField("frequency_penalty", BOTH, _number("frequency_penalty", limits.FREQUENCY_PENALTY)),
    BodyField("presence_penalty", BOTH, _number("presence_penalty", limits.PRESENCE_PENALTY)),
    BodyField("logit_bias", BOTH, _logit_bias),
    BodyField("logprobs", (CHAT,), _chat_logprobs),
    BodyField("top_logprobs", (CHAT,), _top_logprobs),
    BodyField("logprobs", (COMPLETIONS,), _completion_logprobs),
    BodyField("tools", (CHAT,), _tools),
    BodyField("tool_choice", (CHAT,), _tool_choice),
    # accepted and recorded: they change nothing in what is decoded here
    BodyField("parallel_tool_calls", (CHAT,), _recorded("parallel_tool_calls", bool, "true or false")),
    BodyField("user", BOTH, _recorded("user", str, "a string")),
    BodyField("store", (CHAT,), _recorded("store", bool, "true or false")),
    BodyField("metadata", (CHAT,), _metadata),
    BodyField("service_tier", BOTH, _recorded("service_tier", str, "a string")),
    BodyField("stream_options", BOTH, _recorded("stream_options", dict, "an object")),
    BodyField("stream", BOTH, _stream, online_only=True),
)
# The order in which fields are checked: model first, as the error a line with several problems reports.
CHECK_ORDER = ("model", "messages", "prompt", "max_completion_tokens", "max_tokens")


def fields_of(url: str, online: bool = False) -> tuple[BodyField, ...]:
    return tuple(f for f in FIELDS if url in f.endpoints and (online or not f.online_only))


def checking_order(url: str, online: bool = False) -> list[BodyField]:
    """The endpoint's fields in the order they are checked."""
    known = fields_of(url, online)
    first = [f for name in CHECK_ORDER for f in known if f.name == name]
    return first + [f for f in known if f not in first]
