"""Tool calling for ChatSpeculative: the tools in the prompt, a grammar of the call, and the call parsed back.

A call is one JSON object, `{"name": "<tool>", "arguments": {...}}`, written under a grammar (structured
output, docs/structured-output.md), so it always parses and its arguments match the tool's schema:

- tool_choice "any" / "required" / True: the output is a call of one of the tools;
- a tool's name (or {"type": "function", "function": {"name": ...}}): a call of that tool;
- "auto" (the default) : plain text, or a call (the model chooses with its first character: "{" starts a call);
- "none": the tools are left out of the prompt and the output is plain text.

The chat template gets the tools as a system message (templates of small models have no tool syntax) and
earlier calls as the assistant's JSON text, so the model sees the format it is asked to write.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.utils.function_calling import convert_to_openai_tool

from spec_batch import InvalidParameterError
from spec_batch.core.response_format import JSON_OPTIONS

from .schemas import strict_schema

# A call as the model writes it (the grammar's separators: ", " and ": ").
_CALL_PREFIX = re.compile(r'\s*\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


def call_text(name: str, args: dict[str, Any]) -> str:
    """A call as the model writes it (and as earlier calls are shown to it in the prompt)."""
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one call and what the model may answer with."""

    tools: tuple[dict[str, Any], ...]  # OpenAI function specs: {"name", "description", "parameters"}
    choice: str  # "auto" | "none" | "any" | a tool's name

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "ToolPlan | None":
        """Pops `tools` and `tool_choice` (bind_tools' arguments) from a call's kwargs; None without tools."""
        tools = kwargs.pop("tools", None)
        choice = kwargs.pop("tool_choice", None)
        if not tools:
            if choice not in (None, "none", "auto"):
                raise InvalidParameterError(f"tool_choice={choice!r} needs tools (bind_tools)")
            return None
        specs = tuple(_function(t) for t in tools)
        return cls(specs, _choice(choice, [s["name"] for s in specs]))

    @property
    def calls(self) -> tuple[dict[str, Any], ...]:
        """The tools the model may call."""
        if self.choice in ("auto", "any"):
            return self.tools
        if self.choice == "none":
            return ()
        return tuple(t for t in self.tools if t["name"] == self.choice)

    def response_format(self) -> dict[str, Any] | None:
        """The grammar of the answer: a call (json_schema), text or a call (lark), or None (free text)."""
        if self.choice == "none":
            return None
        call = {"anyOf": [_call_schema(t) for t in self.calls]}
        if self.choice != "auto":
            return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": call, "strict": True}}
        call["x-guidance"] = JSON_OPTIONS  # %json takes the engine's options from the schema itself
        # text may not start with "{" (nor be empty): the first character decides between text and a call
        grammar = f"start: call | TEXT\ncall: %json {json.dumps(call)}\nTEXT: /[^{{](.|\\n)*/\n"
        return {"type": "lark", "grammar": grammar}

    def system_prompt(self) -> str | None:
        """The tools described for the model (None under "none")."""
        if self.choice == "none":
            return None
        lines = ["You can call these tools. Their arguments are JSON objects with these JSON schemas:"]
        for t in self.calls:
            desc = f": {t['description']}" if t.get("description") else ""
            lines.append(f"- {t['name']}{desc} Arguments: {json.dumps(t['parameters'], ensure_ascii=False)}")
        example = call_text("<tool name>", {"<argument>": "<value>"})
        if self.choice == "auto":
            lines.append(f"To call a tool, answer with only a JSON object {example}; otherwise answer in plain text.")
        elif self.choice == "any":
            lines.append(f"Answer with only a JSON object that calls one of them: {example}.")
        else:
            lines.append(f"Answer with only a JSON object that calls {self.choice}: {example}.")
        return "\n".join(lines)

    def with_tools_prompt(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages with the tools described in the system message (added first, or appended to it)."""
        prompt = self.system_prompt()
        if prompt is None:
            return messages
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]


def parse_calls(text: str) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(content, tool_calls, invalid_tool_calls) of a finished answer: a call (possibly cut short by
    max_tokens, then an invalid call with the text as its arguments) or plain text."""
    if not text.lstrip().startswith("{"):
        return text, [], []
    call_id = new_call_id()
    try:
        obj = json.loads(text)
        name, args = obj["name"], obj["arguments"]
        if not isinstance(name, str) or not isinstance(args, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as exc:
        match = _CALL_PREFIX.match(text)
        name = json.loads(f'"{match.group(1)}"') if match else None
        args_text = text[match.end():] if match else text
        invalid = {"name": name, "args": args_text, "id": call_id, "error": f"not a complete call: {exc}",
                   "type": "invalid_tool_call"}
        return "", [], [invalid]
    return "", [{"name": name, "args": args, "id": call_id, "type": "tool_call"}], []


class CallStream:
    """Streams an answer: plain text as content; a call as tool_call_chunks (name and id once the name is
    complete, then the arguments' JSON text as it arrives; the call's closing brace is held back)."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = 0  # characters of _text already handed out (content or arguments)
        self._call: bool | None = None
        self._args_start: int | None = None
        self.call_id = new_call_id()

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content, or the call's new tool_call_chunk (at most one per piece: chunks of one message with the
        same index are not merged), for this piece of the answer."""
        self._text += text
        if self._call is None:
            head = self._text.lstrip()
            if not head and not final:
                return "", []
            self._call = head.startswith("{")
        if not self._call:
            out, self._sent = self._text[self._sent:], len(self._text)
            return out, []
        chunk: dict[str, Any] = {"name": None, "args": "", "id": None, "index": 0, "type": "tool_call_chunk"}
        if self._args_start is None:
            match = _CALL_PREFIX.match(self._text)
            if match is None:
                if not final:
                    return "", []
                return "", [{**chunk, "args": self._text, "id": self.call_id}]  # cut short before the name ended
            self._args_start = self._sent = match.end()
            chunk.update(name=json.loads(f'"{match.group(1)}"'), id=self.call_id)
        end = len(self._text) - 1  # the last character may be the call's own closing brace
        if final:
            closed = self._text.rstrip()
            whole = closed.endswith("}") and _balanced(closed[self._args_start : -1])
            end = len(closed) - 1 if whole else len(self._text)
        if end > self._sent:
            chunk["args"] = self._text[self._sent : end]
            self._sent = end
        return "", [chunk] if chunk["name"] is not None or chunk["args"] else []


def _balanced(args_text: str) -> bool:
    """Whether args_text is a whole JSON value (then a "}" after it closes the call)."""
    try:
        json.loads(args_text)
    except ValueError:
        return False
    return True


def _function(tool: Any) -> dict[str, Any]:
    spec = convert_to_openai_tool(tool)["function"]
    params = spec.get("parameters") or {"type": "object", "properties": {}}
    return {"name": spec["name"], "description": spec.get("description", ""), "parameters": params}


def _choice(choice: Any, names: Sequence[str]) -> str:
    if choice is None or choice == "auto":
        return "auto"
    if choice is True or choice in ("any", "required"):
        return "any"
    if choice == "none" or choice is False:
        return "none"
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise InvalidParameterError(
        f"tool_choice must be 'auto', 'any', 'required', 'none' or the name of a bound tool {list(names)}, got {choice!r}"
    )


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, "arguments": strict_schema(tool["parameters"])},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
