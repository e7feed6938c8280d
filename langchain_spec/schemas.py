"""JSON schemas for the grammar: what LangChain hands over, made strict the way OpenAI's strict mode is."""
from __future__ import annotations

from typing import Any


def strict_schema(schema: Any) -> Any:
    """A copy of schema in which every object that lists its properties and says nothing about others allows no
    other keys (`"additionalProperties": false`). Pydantic and TypedDict schemas leave that open, and a small
    model under a grammar that allows extra keys may invent some; an explicit choice in the schema is kept."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_schema(value) if key not in ("enum", "const", "default", "examples") else value
           for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and out.get("type", "object") == "object":
        out["additionalProperties"] = False
    return out
