"""Batch files in: OpenAI Batch API input lines -> valid requests and line-numbered errors (docs/batch-format.md).

A line is an envelope (``custom_id``, ``method``, ``url``, ``body``) around a request body; the body is
validated by spec_batch.openai_format.parse_body, the same parser as the online server's. A line's problems
are reported with its line number; the other lines run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..core.params import SamplingParams
from ..errors import SpecBatchError
from ..openai_format import CHAT, COMPLETIONS, ENDPOINTS, BodyError, parse_body
from ..openai_format.body import DEFAULT_SAMPLING
from ..openai_format.fields import INVALID_VALUE, MISSING_FIELD, UNSUPPORTED_FIELD, lone_surrogate
from ..openai_format.prompts import prompt_list
from ..settings import get_settings

MAX_CUSTOM_ID = 512
TOP_LEVEL_FIELDS = ("custom_id", "method", "url", "body")

# Error codes of invalid lines (those of bodies come from openai_format.fields).
INVALID_JSON = "invalid_json"
INVALID_LINE = "invalid_line"
MISSING_CUSTOM_ID = "missing_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_ENDPOINT = "unsupported_endpoint"
LINE_TOO_LONG = "line_too_long"
# A line over the limit: how much of its start is looked at for its custom_id, and stored.
HEAD_BYTES = 4096
_CUSTOM_ID_AT_START = re.compile(rb'^\s*\{\s*"custom_id"\s*:\s*"((?:[^"\\]|\\.){1,512})"')

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DEFAULT_SAMPLING",
    "DUPLICATE_CUSTOM_ID",
    "ENDPOINTS",
    "INVALID_JSON",
    "INVALID_LINE",
    "INVALID_VALUE",
    "LINE_TOO_LONG",
    "MISSING_CUSTOM_ID",
    "MISSING_FIELD",
    "UNSUPPORTED_ENDPOINT",
    "UNSUPPORTED_FIELD",
    "BatchLineError",
    "BatchRequest",
    "LineError",
    "ParseReport",
    "parse_line",
    "parse_lines",
    "read_batch_file",
]


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
    prompt: Any  # chat: list of {"role", "content"} (content a string); completions: str or list[int], or several
    params: SamplingParams
    raw: str
    model: str | None = None
    max_tokens_field: str | None = None  # the body field that set max_tokens; None: the job's default
    options: dict[str, Any] | None = None  # n, tools, recorded fields: ParsedBody.options() (requests.options)


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
                self.errors.append(
                    LineError(
                        req.line_number,
                        req.raw,
                        INVALID_VALUE,
                        f"line {req.line_number}: {param}: {message}",
                        param,
                        req.custom_id,
                    )
                )
        self.requests = kept
        self.errors.sort(key=lambda e: e.line_number)


def _model_limit_problem(req: BatchRequest, max_context: int | None, vocab_size: int | None) -> tuple[str, str] | None:
    max_tokens = req.params.max_new_tokens
    if max_context is not None and max_tokens >= max_context:
        where = "" if req.max_tokens_field else " (the job's default: --max-tokens)"
        return f"body.{req.max_tokens_field or 'max_tokens'}", (
            f"{max_tokens}{where} leaves no room for the prompt in the model's context of {max_context} tokens; "
            f"ask for fewer than {max_context} tokens"
        )
    if vocab_size is not None:
        bad_bias = next((t for t in req.params.logit_bias if t >= vocab_size), None)
        if bad_bias is not None:
            return f"body.logit_bias.{bad_bias}", (
                f"token id {bad_bias} is not in the model's vocabulary (ids 0..{vocab_size - 1})"
            )
    if vocab_size is not None and req.endpoint == COMPLETIONS:
        return _token_ids_problem(req.prompt, vocab_size)
    return None


def _token_ids_problem(prompt: Any, vocab_size: int) -> tuple[str, str] | None:
    """A token id outside the vocabulary in a completion's prompt (token ids, or several prompts)."""
    several = len(prompt_list(COMPLETIONS, prompt)) > 1
    for k, one in enumerate(prompt_list(COMPLETIONS, prompt)):
        if not isinstance(one, list):
            continue
        bad = next((j for j, t in enumerate(one) if t >= vocab_size), None)
        if bad is not None:
            where = f"body.prompt[{k}][{bad}]" if several else f"body.prompt[{bad}]"
            return where, f"token id {one[bad]} is not in the model's vocabulary (ids 0..{vocab_size - 1})"
    return None


# ---------------------------------------------------------------- one line


def _bad(param: str, message: str, custom_id: str | None) -> BatchLineError:
    return BatchLineError(INVALID_VALUE, f"{param}: {message}", param, custom_id)


def _envelope(obj: dict[str, Any]) -> tuple[str, str | None]:
    """Checks custom_id and the top-level fields; (custom_id, the custom_id to name in errors)."""
    cid = obj.get("custom_id")
    cid_ok = cid if isinstance(cid, str) and cid else None
    if "custom_id" not in obj or cid is None:
        raise BatchLineError(
            MISSING_CUSTOM_ID, "custom_id is missing: every line needs a unique custom_id", "custom_id"
        )
    if not isinstance(cid, str) or not cid:
        raise _bad("custom_id", f"must be a non-empty string, got {cid!r}", None)
    if len(cid) > MAX_CUSTOM_ID:
        raise _bad("custom_id", f"is {len(cid)} characters, at most {MAX_CUSTOM_ID} are allowed", None)
    if lone_surrogate(cid) is not None:
        raise _bad("custom_id", "contains a lone surrogate, which is not valid Unicode text", None)
    extra = [k for k in obj if k not in TOP_LEVEL_FIELDS]
    if extra:
        raise BatchLineError(
            UNSUPPORTED_FIELD,
            f"{extra[0]}: unsupported field (a line has {', '.join(TOP_LEVEL_FIELDS)})",
            extra[0],
            cid_ok,
        )
    method = obj.get("method", "POST")
    if method != "POST":
        raise _bad("method", f'must be "POST", got {method!r}', cid_ok)
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
    return cid, cid_ok


def parse_line(text: str, line_number: int, *, defaults: dict[str, Any] | None = None) -> BatchRequest:
    """Validates one line. Raises BatchLineError (code, message naming the field, param) when invalid.

    defaults: sampling values for fields the line omits (keys of SamplingParams; see DEFAULT_SAMPLING).
    Duplicate custom_ids are a property of the file: parse_lines checks them.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchLineError(INVALID_JSON, f"not valid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:  # Python's parser recurses per level: the line fails alone, the file goes on
        raise BatchLineError(INVALID_JSON, "not valid JSON here: nested too deeply") from None
    if not isinstance(obj, dict):
        raise BatchLineError(INVALID_LINE, f"a line must be a JSON object, got {type(obj).__name__}")
    cid, cid_ok = _envelope(obj)
    url = obj["url"]
    try:
        parsed = parse_body(url, obj["body"], defaults=defaults)
    except BodyError as e:
        if not e.param:  # the body as a whole
            raise BatchLineError(e.code, e.problem, "body", cid_ok) from None
        raise BatchLineError(e.code, f"body.{e}", f"body.{e.param}", cid_ok) from None
    return BatchRequest(
        line_number,
        cid,
        url,
        parsed.prompt,
        parsed.params,
        text,
        parsed.model,
        max_tokens_field=parsed.max_tokens_field,
        options=parsed.options(),
    )


# ---------------------------------------------------------------- a file


def _decode(raw: bytes | str, line_number: int) -> str:
    if isinstance(raw, str):
        text = raw
    else:
        text = raw.decode("utf-8")  # may raise UnicodeDecodeError
    if line_number == 1 and text.startswith("\ufeff"):
        text = text[1:]
    return text.rstrip("\r\n")


@dataclass
class TooLong:
    """A line over the size limit: its first HEAD_BYTES bytes and its size (the rest was skipped unread)."""

    head: bytes
    size: int

    def custom_id(self) -> str | None:
        """The custom_id, when the line starts with it (as OpenAI's own examples do)."""
        m = _CUSTOM_ID_AT_START.match(self.head)
        if m is None:
            return None
        try:
            cid = json.loads(b'"' + m.group(1) + b'"')
        except ValueError:
            return None
        return cid if isinstance(cid, str) and cid else None

    def stored(self) -> str:
        """What the job keeps of the line: its start, marked as cut."""
        head = self.head.decode("utf-8", errors="replace")
        return f"{head}... [cut: the line is {self.size} bytes]"


def iter_lines(fh: BinaryIO, max_bytes: int) -> Iterator[bytes | TooLong]:
    """The file's lines, each read with at most max_bytes + 2 bytes in memory: a line whose content (without its
    line ending) is longer is a TooLong, its rest skipped in bounded chunks."""
    while True:
        line = fh.readline(max_bytes + 2)  # room for the content and its \r\n
        if not line:
            return
        content = len(line) - (2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0)
        if content <= max_bytes:
            yield line
            continue
        head, size = line[:HEAD_BYTES], content
        while not line.endswith(b"\n"):
            line = fh.readline(1 << 16)
            if not line:
                break
            size += len(line) - (1 if line.endswith(b"\n") else 0)
        yield TooLong(head, size)


def _too_long(n: int, line: TooLong, max_bytes: int | None) -> LineError:
    cid = line.custom_id()
    message = (
        f"line {n}: the line is {line.size} bytes, over the limit of {max_bytes} bytes "
        f"(SPEC_BATCH_MAX_LINE_BYTES); it was not parsed: shorten the request or raise the limit"
    )
    return LineError(n, line.stored(), LINE_TOO_LONG, message, None, cid)


def parse_lines(
    lines: Iterable[bytes | str | TooLong], *, defaults: dict[str, Any] | None = None, max_bytes: int | None = None
) -> ParseReport:
    """Validates every line; blank lines are skipped (line numbers still count them). max_bytes: the limit
    TooLong lines broke (for their message)."""
    report = ParseReport()
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        if isinstance(raw, TooLong):
            error = _too_long(n, raw, max_bytes)
            report.errors.append(error)
            if error.custom_id is not None:
                seen.setdefault(error.custom_id, n)
            continue
        try:
            text = _decode(raw, n)
        except UnicodeDecodeError as e:
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")  # type: ignore[union-attr]
            report.errors.append(
                LineError(n, text, INVALID_LINE, f"line {n}: not UTF-8 text ({e.reason} at byte {e.start})")
            )
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
                    n,
                    text,
                    DUPLICATE_CUSTOM_ID,
                    f"line {n}: custom_id {req.custom_id!r} is already used on line {first}; custom_ids must be unique",
                    "custom_id",
                    req.custom_id,
                )
            )
            continue
        seen[req.custom_id] = n
        report.requests.append(req)
    return report


def read_batch_file(
    path: str | Path, *, defaults: dict[str, Any] | None = None, max_line_bytes: int | None = None
) -> ParseReport:
    """Reads and validates a JSONL batch file, line by line (OSError if it cannot be read). A line over
    max_line_bytes (default: settings, SPEC_BATCH_MAX_LINE_BYTES) fails alone without being read whole."""
    limit = max_line_bytes or get_settings().max_line_bytes
    with open(path, "rb") as fh:
        return parse_lines(iter_lines(fh, limit), defaults=defaults, max_bytes=limit)
