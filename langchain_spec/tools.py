"""Tool calling for ChatSpeculative: LangChain tools (functions, Pydantic models, BaseTools) converted to OpenAI's
function specs, then the one tool-call grammar of spec_batch.openai_format.tools (batch lines use it too)."""

from __future__ import annotations

from typing import Any

from langchain_core.utils.function_calling import convert_to_openai_tool

from spec_batch import InvalidParameterError
from spec_batch.openai_format import tools as _tools
from spec_batch.openai_format.tools import CallStream, call_text, new_call_id, parse_calls

__all__ = ["CallStream", "ToolPlan", "call_text", "new_call_id", "parse_calls"]


class ToolPlan(_tools.ToolPlan):
    """The tools of one call (LangChain's bind_tools arguments) and what the model may answer with."""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> ToolPlan | None:
        """Pops `tools` and `tool_choice` (bind_tools' arguments) from a call's kwargs; None without tools."""
        tools = kwargs.pop("tools", None)
        choice = kwargs.pop("tool_choice", None)
        if not tools:
            if choice not in (None, "none", "auto"):
                raise InvalidParameterError(f"tool_choice={choice!r} needs tools (bind_tools)")
            return None
        specs = tuple(_function(t) for t in tools)
        return cls(specs, _tools.choice_of(choice, [s["name"] for s in specs]))


def _function(tool: Any) -> dict[str, Any]:
    spec = convert_to_openai_tool(tool)["function"]
    params = spec.get("parameters") or {"type": "object", "properties": {}}
    return {"name": spec["name"], "description": spec.get("description", ""), "parameters": params}
