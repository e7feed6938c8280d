"""`response_format`: what shape an output must have, parsed from the OpenAI forms and two extensions.

    {"type": "text"}                                   no constraint (parses to None)
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    {"type": "regex", "pattern": "..."}                extension: the whole output matches the pattern
    {"type": "choice", "choices": ["yes", "no"]}       extension: the output is exactly one of the strings
    {"type": "lark", "grammar": "start: ..."}          extension: a grammar in llguidance's Lark syntax (which
                                                       embeds JSON schemas with %json; "text or a tool call")

A ResponseFormat is tokenizer-independent; spec_batch.core.structured.grammar compiles it for one tokenizer. The grammar
text is checked here by the engine (without a tokenizer), so a schema or pattern it cannot compile is an
InvalidParameterError with the engine's reason as soon as SamplingParams is built (a batch line error, not a
failure in the middle of a job). What the engine refuses is bounded up front: the grammar's text
(MAX_GRAMMAR_CHARS), and the work its limits allow (GRAMMAR_LIMITS), which a probe over single bytes tries on the
run of bytes the grammar forces from its start (a repetition such as `a{1000000}`, or a rule that recurses
forever, exceeds them at its first token). A grammar that exceeds them only later fails its own request while
decoding (core/structured/grammar.py: GrammarState.failure), never the batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from ...errors import InvalidParameterError

FormatType = Literal["json_object", "json_schema", "regex", "choice", "lark"]
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice", "lark")

# JSON is generated compactly with Python's separators: no free whitespace (the model cannot pad with newlines
# forever) and every separator is a fixed string, so keys and punctuation become forced tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FIELDS: dict[str, set[str]] = {
    "text": set(),
    "json_object": set(),
    "json_schema": {"json_schema"},
    "regex": {"pattern"},
    "choice": {"choices"},
    "lark": {"grammar"},
}
_SCHEMA_KEYS = {"name", "schema", "strict", "description"}

# The longest grammar text accepted (a schema as compact JSON, a pattern, choices, a Lark grammar): compiling is
# done on the caller's thread before decoding, so its cost must be bounded whatever a client sends.
MAX_GRAMMAR_CHARS = 100_000


def grammar_limits() -> LLParserLimits:
    """The engine's limits for every matcher of the project: its default budgets, and errors without the engine's
    parser state and grammar text (a client must never see those dumps)."""
    return LLParserLimits(verbose_errors=False)


def engine_reason(message: str) -> str:
    """The first line of a matcher's error, bounded: the reason, never a dump that follows it (the parser's
    state and the grammar, even where verbose errors are off)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return first if len(first) <= 200 else first[:197] + "..."


@dataclass(frozen=True)
class ResponseFormat:
    """A parsed, validated response_format. `spec` is canonical text: the schema as compact JSON, the
    pattern, or the choices as JSON; (type, spec) identifies the grammar (the compile cache's key)."""

    type: FormatType
    spec: str
    name: str | None = None  # json_schema's name and description: carried for the round trip only
    description: str | None = None
    strict: bool | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.type, self.spec)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output validates against (json_object: {"type": "object"}); None otherwise."""
        if self.type in ("json_object", "json_schema"):
            return json.loads(self.spec)
        return None

    def grammar(self) -> str:
        """The engine's grammar text (tokenizer-independent)."""
        return _grammar(self.type, self.spec)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI-shaped dict this was parsed from (normalized): plain JSON for the job store."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "regex":
            return {"type": "regex", "pattern": self.spec}
        if self.type == "choice":
            return {"type": "choice", "choices": json.loads(self.spec)}
        if self.type == "lark":
            return {"type": "lark", "grammar": self.spec}
        inner: dict[str, Any] = {"name": self.name, "schema": json.loads(self.spec)}
        if self.description is not None:
            inner["description"] = self.description
        if self.strict is not None:
            inner["strict"] = self.strict
        return {"type": "json_schema", "json_schema": inner}


def parse_response_format(obj: Any) -> ResponseFormat | None:
    """Validates a response_format object; None means unconstrained text. Errors name the offending field."""
    if obj is None or isinstance(obj, ResponseFormat):
        return obj
    if not isinstance(obj, dict):
        raise _bad("response_format", f'must be an object like {{"type": "json_object"}}, got {type(obj).__name__}')
    kind = obj.get("type")
    if kind not in FORMAT_TYPES:
        raise _bad("response_format.type", f"must be one of {list(FORMAT_TYPES)}, got {kind!r}")
    extra = sorted(set(obj) - {"type"} - _FIELDS[kind])
    if extra:
        raise _bad("response_format", f"unknown field(s) {extra} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        fmt = ResponseFormat("json_object", _canonical({"type": "object"}))
    elif kind == "json_schema":
        fmt = _parse_json_schema(obj.get("json_schema"))
    elif kind == "regex":
        pattern = obj.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise _bad("response_format.pattern", f"must be a non-empty string, got {pattern!r}")
        fmt = ResponseFormat("regex", pattern)
    elif kind == "lark":
        grammar = obj.get("grammar")
        if not isinstance(grammar, str) or not grammar.strip():
            raise _bad("response_format.grammar", f"must be a non-empty Lark grammar, got {grammar!r}")
        fmt = ResponseFormat("lark", grammar)
    else:
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise _bad("response_format.choices", f"must be a non-empty list of non-empty strings, got {choices!r}")
        fmt = ResponseFormat("choice", json.dumps(choices, ensure_ascii=False))
    field = {
        "json_schema": "response_format.json_schema.schema",
        "regex": "response_format.pattern",
        "lark": "response_format.grammar",
    }.get(fmt.type, "response_format")
    if len(fmt.spec) > MAX_GRAMMAR_CHARS:
        raise _bad(field, f"is {len(fmt.spec)} characters long; at most {MAX_GRAMMAR_CHARS} are accepted")
    reason = _engine_error(fmt.type, fmt.spec)
    if reason:
        raise _bad(field, f"the grammar engine cannot compile it: {reason}")
    probe = _probe(fmt.type, fmt.spec)
    if probe == _EMPTY:
        raise _bad(field, f'matches no string at all (not even ""): {NO_STRING}')
    if probe:
        raise _bad(field, f"exceeds the grammar engine's limits: {probe}; {TOO_COMPLEX}")
    return fmt


def _parse_json_schema(inner: Any) -> ResponseFormat:
    where = "response_format.json_schema"
    if not isinstance(inner, dict):
        raise _bad(where, f"must be an object with name and schema, got {type(inner).__name__}")
    extra = sorted(set(inner) - _SCHEMA_KEYS)
    if extra:
        raise _bad(where, f"unknown field(s) {extra}; known: {sorted(_SCHEMA_KEYS)}")
    name = inner.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name", f"must be a non-empty string, got {name!r}")
    schema = inner.get("schema")
    if not isinstance(schema, dict):
        raise _bad(f"{where}.schema", f"must be a JSON schema object, got {type(schema).__name__}")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.strict", f"must be true or false, got {strict!r}")
    description = inner.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.description", f"must be a string, got {type(description).__name__}")
    try:
        spec = _canonical(schema)
    except (TypeError, ValueError) as e:
        raise _bad(f"{where}.schema", f"is not JSON: {e}") from None
    return ResponseFormat("json_schema", spec, name=name, description=description, strict=strict)


def _canonical(schema: dict) -> str:
    # keys keep their order: the engine emits properties in the schema's order
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


@lru_cache(maxsize=256)
def _grammar(kind: str, spec: str) -> str:
    if kind in ("json_object", "json_schema"):
        return LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return LLMatcher.grammar_from_lark(spec)
    choices = json.loads(spec)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


@lru_cache(maxsize=1024)
def _engine_error(kind: str, spec: str) -> str:
    """The engine's reason a grammar does not compile ("" when it does); cached, so a job of many lines with
    one schema checks it once."""
    try:
        return LLMatcher.validate_grammar(_grammar(kind, spec), limits=grammar_limits())
    except ValueError as e:
        return str(e)


NO_STRING = "no output can satisfy it; fix the pattern or grammar"
TOO_COMPLEX = "use shorter repetitions, or rules that can end"


class _Bytes:
    """A vocabulary of the 256 single bytes (and EOS): under it a grammar's first mask is exact over every string,
    so "nothing is allowed, not even EOS" means the grammar's language is empty. No model tokenizer needed."""

    tokens = [bytes([b]) for b in range(256)] + [b""]
    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_Bytes()), eos_token=_Bytes.eos_token_id)


def starts_dead(matcher: LLMatcher) -> bool:
    """A fresh matcher that allows nothing, not even the end: its grammar accepts no string. (llguidance stops
    such a matcher at its first mask, reason NoExtensionBias.)"""
    if matcher.is_error():
        return matcher.stop_reason() == "NoExtensionBias"
    matcher.compute_bitmask()
    return matcher.stop_reason() == "NoExtensionBias" or (matcher.is_stopped() and not matcher.is_accepting())


_EMPTY = "matches nothing"


@lru_cache(maxsize=1024)
def _probe(kind: str, spec: str) -> str:
    """What a matcher over single bytes finds at the grammar's start ("" when nothing is wrong); cached like
    _engine_error. _EMPTY: it accepts no string (a regex such as `[a&&b]` or `[^\\s\\S]`: validate_grammar accepts
    those, only a matcher sees that its start allows nothing). Otherwise the engine's reason for giving up on the
    first token of the run of bytes the grammar forces: consuming a token makes the engine look ahead through the
    whole forced run, so a forced run beyond its limits fails there, as it would at a request's first token."""
    matcher = LLMatcher(_byte_tokenizer(), _grammar(kind, spec), log_level=0, limits=grammar_limits())
    if starts_dead(matcher):
        return _EMPTY
    forced = matcher.compute_ff_tokens()
    if forced and not matcher.is_error():
        matcher.consume_token(forced[0])
    return engine_reason(matcher.get_error()) if matcher.is_error() else ""


class ResponseFormatError(InvalidParameterError):
    """An invalid response_format: `field` names the part (``response_format.json_schema.schema``) and
    `problem` says what is wrong; the message is both."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def _bad(field: str, message: str) -> ResponseFormatError:
    return ResponseFormatError(field, message)
