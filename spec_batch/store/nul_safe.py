"""Column types that store NUL (U+0000) on PostgreSQL, which refuses it in text ("cannot contain NUL") and in
JSONB ("unsupported Unicode escape sequence"), while SQLite stores it as it is (issue 38, defect 2).

On PostgreSQL a string is escaped on the way in and restored on the way out, recursively inside JSON (keys and
values): NUL becomes ESC + "0" and ESC itself ESC + "e", so the mapping is injective and round-trips exactly.
ESC is U+FFFF, a Unicode noncharacter ("permanently reserved for internal use"), so text without NUL is stored
unchanged unless it holds that noncharacter. SQLite values are never touched: its stored data is as before.
Comparisons (``column == value``, ``in_``) escape their value too, so lookups by a user's string still match.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import JSON, String, Text, TypeDecorator
from sqlalchemy.dialects.postgresql import JSONB

NUL = "\x00"
ESC = "\uffff"
_ESCAPED = re.compile("\uffff([0e])")
_RESTORE = {"0": NUL, "e": ESC}


def escape_nul(value: str) -> str:
    """The string as PostgreSQL stores it (unchanged when it holds neither NUL nor ESC)."""
    if NUL not in value and ESC not in value:
        return value
    return value.replace(ESC, ESC + "e").replace(NUL, ESC + "0")


def restore_nul(value: str) -> str:
    """The inverse of escape_nul; an ESC not followed by 0 or e (not written by it) is left as it is."""
    if ESC not in value:
        return value
    return _ESCAPED.sub(lambda m: _RESTORE[m.group(1)], value)


def _walk(value: Any, fn: Any) -> Any:
    """`fn` applied to every string inside a JSON value (dict keys too); other values unchanged."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {(fn(k) if isinstance(k, str) else k): _walk(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_walk(v, fn) for v in value]
    return value


def _postgres(dialect: Any) -> bool:
    return dialect.name == "postgresql"


class NulSafeString(TypeDecorator):
    """VARCHAR(n) that stores NUL on PostgreSQL (see the module docstring)."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return escape_nul(value) if isinstance(value, str) and _postgres(dialect) else value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return restore_nul(value) if isinstance(value, str) and _postgres(dialect) else value


class NulSafeText(NulSafeString):
    """TEXT that stores NUL on PostgreSQL."""

    impl = Text
    cache_ok = True


class NulSafeJSON(TypeDecorator):
    """JSON (JSONB on PostgreSQL) whose strings may hold NUL: escaped inside the document on PostgreSQL."""

    impl = JSON
    cache_ok = True

    @property
    def should_evaluate_none(self) -> bool:  # as JSON's: a Python None is stored as JSON null, as before
        return self.impl_instance.should_evaluate_none

    def load_dialect_impl(self, dialect: Any) -> Any:
        return dialect.type_descriptor(JSONB() if _postgres(dialect) else JSON())

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return _walk(value, escape_nul) if _postgres(dialect) else value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return _walk(value, restore_nul) if _postgres(dialect) else value


__all__ = ["ESC", "NulSafeJSON", "NulSafeString", "NulSafeText", "escape_nul", "restore_nul"]
