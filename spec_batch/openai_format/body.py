"""One request body of /v1/chat/completions or /v1/completions -> the core's SamplingParams and prompt.

Batch lines (spec_batch.jobs.batch_input, after the line's envelope) and the online server both call
`parse_body`, so a body means the same thing in a file and over HTTP. Each field has its validator in
`fields.FIELDS`; an unknown field is an error that names it, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.params import SamplingParams
from ..errors import InvalidParameterError
from .fields import (
    CHAT,
    COMPLETIONS,
    INVALID_VALUE,
    MISSING_FIELD,
    RECORDED,
    UNSUPPORTED_FIELD,
    BodyError,
    check_unicode,
    checking_order,
    fields_of,
)
from .tools import ToolError, ToolPlan

ENDPOINTS = (CHAT, COMPLETIONS)
# Values for fields a body omits (or sets to null): SamplingParams keys. A job overrides them (its --max-tokens...).
DEFAULT_SAMPLING: dict[str, Any] = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0}
_SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "response_format",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
)


@dataclass
class ParsedBody:
    """A valid body: what to decode (prompt: chat messages, a string or token ids) and how."""

    endpoint: str
    prompt: Any
    params: SamplingParams
    model: str | None = None
    max_tokens_field: str | None = None  # the body field that set max_tokens; None: the default
    n: int = 1
    tools: ToolPlan | None = None  # tools and tool_choice (chat); the prompt and params already carry them
    recorded: dict[str, Any] = field(default_factory=dict)  # fields accepted that change nothing here, as given
    stream: bool = False  # online requests only: answer as server-sent events

    def options(self) -> dict[str, Any] | None:
        """What a stored request keeps beyond its SamplingParams (requests.options); None when nothing."""
        out: dict[str, Any] = {}
        if self.n != 1:
            out["n"] = self.n
        if self.tools is not None:
            out["tools"] = self.tools.to_dict()
        if self.recorded:
            out["recorded"] = self.recorded
        return out or None


def parse_body(url: str, body: Any, *, defaults: dict[str, Any] | None = None, online: bool = False) -> ParsedBody:
    """Validates one request body for the endpoint `url`. Raises BodyError (code, param naming the field
    relative to the body, "" for the body as a whole, problem) at the first problem. `defaults` are
    SamplingParams values for omitted fields. online=True: an HTTP request, which may also ask to `stream`."""
    if url not in ENDPOINTS:
        raise ValueError(f"url {url!r} is not an endpoint of this parser: {ENDPOINTS}")
    if not isinstance(body, dict):
        raise BodyError(INVALID_VALUE, "", f"the request body must be a JSON object, got {type(body).__name__}")
    known = fields_of(url, online)
    names = [f.name for f in known]
    extra = [k for k in body if k not in names]
    if extra:
        raise BodyError(UNSUPPORTED_FIELD, extra[0], f"unsupported field for {url} (supported: {', '.join(names)})")
    check_unicode(body)
    values: dict[str, Any] = {}
    for f in checking_order(url, online):
        value = body.get(f.name)
        if value is None:
            if f.required:
                raise BodyError(MISSING_FIELD, f.name, "is missing", separator=" ")
            continue
        values.update(f.check(value, body))
    plan = _tool_plan(values)
    if plan is not None and plan.choice != "none":
        values["prompt"] = plan.with_tools_prompt(values["prompt"])
        values["response_format"] = plan.response_format()
    return ParsedBody(
        endpoint=url,
        prompt=values.pop("prompt"),
        params=_sampling_params(values, {**DEFAULT_SAMPLING, **(defaults or {})}),
        model=values.get("model"),
        max_tokens_field=values.get("max_tokens_field"),
        n=values.get("n", 1),
        tools=plan,
        recorded={k[len(RECORDED) :]: v for k, v in values.items() if k.startswith(RECORDED)},
        stream=values.get("stream", False),
    )


def _tool_plan(values: dict[str, Any]) -> ToolPlan | None:
    """The tools' plan (tools and tool_choice checked together); a call has its own format, so a
    response_format beside tools is an error."""
    try:
        plan = ToolPlan.from_openai(values.get("tools"), values.get("tool_choice"))
    except ToolError as e:
        raise BodyError(INVALID_VALUE, e.param, e.problem) from None
    if plan is not None and plan.choice != "none" and values.get("response_format") is not None:
        raise BodyError(
            INVALID_VALUE, "response_format", "give tools or response_format, not both: a tool call has its own format"
        )
    return plan


def _sampling_params(values: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    chosen = {k: values[k] if k in values else defaults[k] for k in _SAMPLING_KEYS if k in values or k in defaults}
    try:
        return SamplingParams(**chosen)
    except InvalidParameterError as e:  # a default out of range (the job's own options)
        raise BodyError(INVALID_VALUE, "", str(e), separator="") from None
