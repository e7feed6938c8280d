"""Batch files: OpenAI Batch API input lines in, OpenAI output and error lines out.

Input line (one JSON object per line; blank lines are skipped)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64}}

Supported: ``url`` ``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``: a
string or a list of token ids); body fields ``model`` (recorded, not used: the job's target decides),
``max_tokens`` (chat also ``max_completion_tokens``), ``temperature`` [0, 2], ``top_p`` (0, 1], ``seed``,
``stop`` (a string or up to 4), ``n`` (1 only), ``response_format`` (``text``, ``json_object``, ``json_schema``,
and the extensions ``regex`` and ``choice``: docs/structured-output.md; a schema the grammar engine cannot
compile is an error for that line, with the engine's reason). ``null`` means "the job's default". Any other field is an error
for that line, never ignored. A line's problems are reported with its line number; the other lines run.

Output lines (``OUT.jsonl``, successes, in input order)::

    {"id": "batch_req_12", "custom_id": "r1", "response": {"status_code": 200, "request_id": "req_12",
     "body": {"id": "chatcmpl-12", "object": "chat.completion", "created": 1700000000, "model": "<target>",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                           "logprobs": null, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50,
                        "speculative": {"drafter": "ngram", "draft_tokens": .., "accepted_tokens": ..,
                                        "acceptance_rate": .., "target_forwards": .., "tokens_per_step": .., ...}}}},
     "error": null}

Error lines (``OUT.errors.jsonl``): an invalid line or a cancelled request has ``"response": null`` and
``"error": {"code", "message", "param", "line"}``; a request that failed while decoding (e.g. a prompt too long
for the context) has ``"response": {"status_code": 400, "body": {"error": {"message", "type", "param", "code",
"line"}}}`` and ``"error": null``, as OpenAI's error files do.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidParameterError, SpecBatchError
from ..core.response_format import parse_response_format
from ..core.params import SamplingParams
from ..store.models import REQ_CANCELLED
from .stats import stats_of_row
from ..loading.chat import MessageError, validate_messages

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
MAX_CUSTOM_ID = 512
MAX_STOP = 4

TOP_LEVEL_FIELDS = ("custom_id", "method", "url", "body")
COMMON_BODY_FIELDS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "response_format")
BODY_FIELDS = {
    CHAT: ("messages", "max_completion_tokens") + COMMON_BODY_FIELDS,
    COMPLETIONS: ("prompt",) + COMMON_BODY_FIELDS,
}

# Error codes of invalid lines.
INVALID_JSON = "invalid_json"
INVALID_LINE = "invalid_line"
MISSING_CUSTOM_ID = "missing_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_FIELD = "unsupported_field"
UNSUPPORTED_ENDPOINT = "unsupported_endpoint"
INVALID_VALUE = "invalid_value"
MISSING_FIELD = "missing_field"

DEFAULT_SAMPLING = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0}


class BatchLineError(SpecBatchError, ValueError):
    """One invalid line of a batch file."""

    def __init__(self, code: str, message: str, param: str | None = None, custom_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.custom_id = custom_id


@dataclass
class BatchRequest:
    """A valid line: what to decode and how."""

    line_number: int
    custom_id: str
    endpoint: str
    prompt: Any  # chat: list of {"role", "content"} (content a string); completions: str or list[int]
    params: SamplingParams
    raw: str
    model: str | None = None
    max_tokens_field: str | None = None  # the body field that set max_tokens; None: the job's default

    def params_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "max_new_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "seed": p.seed,
            "stop": list(p.stop),
            "response_format": p.response_format,
        }


@dataclass
class LineError:
    """An invalid line: its number, the line as read, and why."""

    line_number: int
    raw: str
    code: str
    message: str
    param: str | None = None
    custom_id: str | None = None

    def to_error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line_number}


@dataclass
class ParseReport:
    requests: list[BatchRequest] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def n_lines(self) -> int:
        """Non-blank lines: every one is a request of the job, valid or not."""
        return len(self.requests) + len(self.errors)

    def entries(self) -> list[BatchRequest | LineError]:
        """Valid and invalid lines together, in file order."""
        return sorted([*self.requests, *self.errors], key=lambda e: e.line_number)

    def check_model_limits(self, *, max_context: int | None = None, vocab_size: int | None = None) -> None:
        """Moves to the errors the requests the model cannot run whatever their prompt: max_tokens that leaves no
        room for a prompt in the context, token ids outside the vocabulary (when the model is known)."""
        kept = []
        for req in self.requests:
            problem = _model_limit_problem(req, max_context, vocab_size)
            if problem is None:
                kept.append(req)
            else:
                param, message = problem
                self.errors.append(LineError(req.line_number, req.raw, INVALID_VALUE,
                                             f"line {req.line_number}: {param}: {message}", param, req.custom_id))
        self.requests = kept
        self.errors.sort(key=lambda e: e.line_number)


def _model_limit_problem(req: BatchRequest, max_context: int | None, vocab_size: int | None) -> tuple[str, str] | None:
    max_tokens = req.params.max_new_tokens
    if max_context is not None and max_tokens >= max_context:
        where = "" if req.max_tokens_field else " (the job's default: --max-tokens)"
        return req.max_tokens_field or "body.max_tokens", (
            f"{max_tokens}{where} leaves no room for the prompt in the model's context of {max_context} tokens; "
            f"ask for fewer than {max_context} tokens"
        )
    if vocab_size is not None and req.endpoint == COMPLETIONS and isinstance(req.prompt, list):
        bad = next((j for j, t in enumerate(req.prompt) if t >= vocab_size), None)
        if bad is not None:
            return f"body.prompt[{bad}]", (
                f"token id {req.prompt[bad]} is not in the model's vocabulary (ids 0..{vocab_size - 1})"
            )
    return None


# ---------------------------------------------------------------- parsing


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _bad(param: str, message: str, custom_id: str | None) -> BatchLineError:
    return BatchLineError(INVALID_VALUE, f"{param}: {message}", param, custom_id)


def parse_line(text: str, line_number: int, *, defaults: dict[str, Any] | None = None) -> BatchRequest:
    """Validates one line. Raises BatchLineError (code, message naming the field, param) when invalid.

    defaults: sampling values for fields the line omits (keys of SamplingParams; see DEFAULT_SAMPLING).
    Duplicate custom_ids are a property of the file: parse_lines checks them.
    """
    defaults = {**DEFAULT_SAMPLING, **(defaults or {})}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchLineError(INVALID_JSON, f"not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BatchLineError(INVALID_LINE, f"a line must be a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    cid_ok = cid if isinstance(cid, str) and cid else None
    if "custom_id" not in obj or cid is None:
        raise BatchLineError(MISSING_CUSTOM_ID, "custom_id is missing: every line needs a unique custom_id", "custom_id")
    if not isinstance(cid, str) or not cid:
        raise _bad("custom_id", f"must be a non-empty string, got {cid!r}", None)
    if len(cid) > MAX_CUSTOM_ID:
        raise _bad("custom_id", f"is {len(cid)} characters, at most {MAX_CUSTOM_ID} are allowed", None)
    extra = [k for k in obj if k not in TOP_LEVEL_FIELDS]
    if extra:
        raise BatchLineError(
            UNSUPPORTED_FIELD,
            f"{extra[0]}: unsupported field (a line has {', '.join(TOP_LEVEL_FIELDS)})", extra[0], cid_ok,
        )
    method = obj.get("method", "POST")
    if method != "POST":
        raise _bad("method", f"must be \"POST\", got {method!r}", cid_ok)
    url = obj.get("url")
    if url is None:
        raise BatchLineError(MISSING_FIELD, f"url is missing: use {CHAT} or {COMPLETIONS}", "url", cid_ok)
    if url not in ENDPOINTS:
        raise BatchLineError(
            UNSUPPORTED_ENDPOINT, f"url {url!r} is not supported: use {CHAT} or {COMPLETIONS}", "url", cid_ok
        )
    body = obj.get("body")
    if body is None:
        raise BatchLineError(MISSING_FIELD, "body is missing", "body", cid_ok)
    if not isinstance(body, dict):
        raise _bad("body", f"must be an object, got {type(body).__name__}", cid_ok)
    allowed = BODY_FIELDS[url]
    extra = [k for k in body if k not in allowed]
    if extra:
        raise BatchLineError(
            UNSUPPORTED_FIELD,
            f"body.{extra[0]}: unsupported field for {url} (supported: {', '.join(allowed)})",
            f"body.{extra[0]}", cid_ok,
        )

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("body.model", f"must be a string, got {type(model).__name__}", cid_ok)

    if url == CHAT:
        messages = body.get("messages")
        if messages is None:
            raise BatchLineError(MISSING_FIELD, "body.messages is missing", "body.messages", cid_ok)
        try:
            prompt: Any = validate_messages(messages)
        except MessageError as e:
            code = UNSUPPORTED_FIELD if e.unsupported_field else INVALID_VALUE
            raise BatchLineError(code, f"body.{e}", f"body.{e.param}", cid_ok) from None
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise BatchLineError(MISSING_FIELD, "body.prompt is missing", "body.prompt", cid_ok)
        if isinstance(prompt, list):
            if not prompt or not all(_is_int(t) for t in prompt):
                raise _bad(
                    "body.prompt",
                    "must be a string or a non-empty list of token ids (one prompt per line: put several "
                    "prompts on several lines)", cid_ok,
                )
            negative = next((j for j, t in enumerate(prompt) if t < 0), None)
            if negative is not None:
                raise _bad(f"body.prompt[{negative}]", f"token id {prompt[negative]} is negative; token ids are >= 0",
                           cid_ok)
        elif not isinstance(prompt, str) or not prompt:
            raise _bad("body.prompt", "must be a non-empty string", cid_ok)

    max_tokens = body.get("max_tokens")
    if url == CHAT and body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise _bad("body.max_completion_tokens", "give max_tokens or max_completion_tokens, not both", cid_ok)
        max_tokens = body["max_completion_tokens"]
        mt_name = "body.max_completion_tokens"
    else:
        mt_name = "body.max_tokens"
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise _bad(mt_name, f"must be an integer >= 1, got {max_tokens!r}", cid_ok)
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= 2):
        raise _bad("body.temperature", f"must be a number in [0, 2], got {temperature!r}", cid_ok)
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise _bad("body.top_p", f"must be a number in (0, 1], got {top_p!r}", cid_ok)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("body.seed", f"must be an integer, got {seed!r}", cid_ok)
    stop = body.get("stop")
    if stop is None:
        stop_list: list[str] = []
    elif isinstance(stop, str):
        stop_list = [stop]
    elif isinstance(stop, list):
        stop_list = stop
    else:
        raise _bad("body.stop", f"must be a string or a list of strings, got {type(stop).__name__}", cid_ok)
    if len(stop_list) > MAX_STOP or not all(isinstance(s, str) and s for s in stop_list):
        raise _bad("body.stop", f"must be at most {MAX_STOP} non-empty strings, got {stop!r}", cid_ok)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad("body.n", f"only n=1 is supported (one line per output), got {n!r}", cid_ok)

    try:
        response_format = parse_response_format(body.get("response_format"))
    except InvalidParameterError as e:  # the message starts with the field it names
        param = "body." + str(e).split(" ", 1)[0]
        raise BatchLineError(INVALID_VALUE, f"body.{e}", param, cid_ok) from None
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens if max_tokens is not None else int(defaults["max_new_tokens"]),
            temperature=float(temperature) if temperature is not None else float(defaults["temperature"]),
            top_p=float(top_p) if top_p is not None else float(defaults["top_p"]),
            top_k=int(defaults.get("top_k", 0)),
            seed=seed,
            stop=stop_list,
            response_format=response_format.to_dict() if response_format is not None else None,
        )
    except InvalidParameterError as e:
        raise BatchLineError(INVALID_VALUE, str(e), "body", cid_ok) from None
    return BatchRequest(line_number, cid, url, prompt, params, text, model,
                        max_tokens_field=mt_name if max_tokens is not None else None)


def _decode(raw: bytes | str, line_number: int) -> str:
    if isinstance(raw, str):
        text = raw
    else:
        text = raw.decode("utf-8")  # may raise UnicodeDecodeError
    if line_number == 1 and text.startswith("\ufeff"):
        text = text[1:]
    return text.rstrip("\r\n")


def parse_lines(lines: Iterable[bytes | str], *, defaults: dict[str, Any] | None = None) -> ParseReport:
    """Validates every line; blank lines are skipped (line numbers still count them)."""
    report = ParseReport()
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        try:
            text = _decode(raw, n)
        except UnicodeDecodeError as e:
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")  # type: ignore[union-attr]
            report.errors.append(LineError(n, text, INVALID_LINE, f"line {n}: not UTF-8 text ({e.reason} at byte {e.start})"))
            continue
        if not text.strip():
            continue
        try:
            req = parse_line(text, n, defaults=defaults)
        except BatchLineError as e:
            report.errors.append(LineError(n, text, e.code, f"line {n}: {e.message}", e.param, e.custom_id))
            if e.custom_id is not None:
                seen.setdefault(e.custom_id, n)
            continue
        first = seen.get(req.custom_id)
        if first is not None:
            report.errors.append(
                LineError(
                    n, text, DUPLICATE_CUSTOM_ID,
                    f"line {n}: custom_id {req.custom_id!r} is already used on line {first}; custom_ids must be unique",
                    "custom_id", req.custom_id,
                )
            )
            continue
        seen[req.custom_id] = n
        report.requests.append(req)
    return report


def read_batch_file(path: str | Path, *, defaults: dict[str, Any] | None = None) -> ParseReport:
    """Reads and validates a JSONL batch file (OSError if it cannot be read)."""
    with open(path, "rb") as fh:
        return parse_lines(fh, defaults=defaults)


def custom_id_of(raw: str) -> str | None:
    """The custom_id of a line, if it has a string one (for error lines of invalid input)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


# ---------------------------------------------------------------- output


def errors_path_for(out_path: str | Path) -> Path:
    """OUT.jsonl -> OUT.errors.jsonl beside it."""
    p = Path(out_path)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".errors.jsonl")


def _usage(req: Any, drafter: str) -> dict[str, Any]:
    stats = stats_of_row(req)
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.output_tokens,
        "total_tokens": stats.prompt_tokens + stats.output_tokens,
        "speculative": {
            "drafter": drafter,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "target_forwards": stats.target_forwards,
            "draft_forwards": stats.draft_forwards,
            "forced_tokens": stats.forced_tokens,
            "tokens_per_step": stats.tokens_per_step,
            "accepted_length_histogram": stats.accepted_length_histogram,
            "wall_s": stats.wall_s,
            "tokens_per_s": stats.tokens_per_s,
        },
    }


def output_line(req: Any, *, model: str, drafter: str) -> dict[str, Any]:
    """The OpenAI output line of a completed request row (spec_batch.store.Request or alike)."""
    created = int(req.completed_at.timestamp()) if req.completed_at is not None else 0
    if req.endpoint == CHAT:
        body = {
            "id": f"chatcmpl-{req.id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": req.output or ""},
                    "logprobs": None,
                    "finish_reason": req.finish_reason,
                }
            ],
        }
    else:
        body = {
            "id": f"cmpl-{req.id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": req.output or "", "logprobs": None, "finish_reason": req.finish_reason}],
        }
    body["usage"] = _usage(req, drafter)
    return {
        "id": f"batch_req_{req.id}",
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{req.id}", "body": body},
        "error": None,
    }


# Codes of requests that failed while decoding (response.status_code 500 for internal ones, else 400).
INTERNAL_ERROR = "internal_error"


def error_line(req: Any) -> dict[str, Any]:
    """The OpenAI error-file line of a failed or cancelled request row."""
    custom_id = req.custom_id if req.custom_id is not None else custom_id_of(req.input)
    code = req.error_code or "error"
    if req.endpoint is None or req.status == REQ_CANCELLED:  # an invalid line, or cancelled: no HTTP response
        return {
            "id": f"batch_req_{req.id}",
            "custom_id": custom_id,
            "response": None,
            "error": {
                "code": code,
                "message": req.error or code,
                "param": getattr(req, "error_param", None),
                "line": req.line_number,
            },
        }
    status = 500 if code == INTERNAL_ERROR else 400
    return {
        "id": f"batch_req_{req.id}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"req_{req.id}",
            "body": {
                "error": {
                    "message": f"line {req.line_number}, custom_id {custom_id!r}: {req.error}",
                    "type": "server_error" if status == 500 else "invalid_request_error",
                    "param": getattr(req, "error_param", None),
                    "code": code,
                    "line": req.line_number,
                }
            },
        },
        "error": None,
    }


def write_jsonl(path: str | Path, lines: Iterable[dict[str, Any]]) -> int:
    """Writes lines atomically (a temporary file renamed over `path`). Returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)
