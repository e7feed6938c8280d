"""JSON schemas for the grammar: what LangChain hands over, made strict the way OpenAI's strict mode is (the
function lives with the tool-call grammar in spec_batch.openai_format.tools)."""

from __future__ import annotations

from spec_batch.openai_format.tools import strict_schema

__all__ = ["strict_schema"]
