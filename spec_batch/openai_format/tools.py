"""Tool calling: the tools in the prompt, a grammar of the call, and the call parsed back. Used by batch lines
and the server (`tools` / `tool_choice` in a chat body) and by the LangChain chat model (langchain_spec.tools
converts LangChain tools to OpenAI's function specs and uses this).

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

from ..core.structured.response_format import JSON_OPTIONS
from ..errors import InvalidParameterError


class ToolError(InvalidParameterError):
    """Invalid tools or tool_choice: `param` names the field (tools[1].function.name), `problem` says why."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param} {problem}")
        self.param = param
        self.problem = problem


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
    def from_openai(cls, tools: Any, choice: Any = None) -> ToolPlan | None:
        """The plan of OpenAI's `tools` (function tools) and `tool_choice`; None without tools. Raises
        InvalidParameterError naming the tool (tools[i]...) or tool_choice."""
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ToolError("tool_choice", f"{choice!r} needs tools")
            return None
        if not isinstance(tools, list):
            raise ToolError("tools", f"must be a list of function tools, got {type(tools).__name__}")
        specs = tuple(function_spec(t, f"tools[{i}]") for i, t in enumerate(tools))
        return cls(specs, choice_of(choice, [s["name"] for s in specs]))

    def to_dict(self) -> dict[str, Any]:
        """What a stored request keeps of its plan (export renders tool calls from it)."""
        return {"tool_choice": self.choice, "tools": [t["name"] for t in self.tools]}

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
        args_text = text[match.end() :] if match else text
        invalid = {
            "name": name,
            "args": args_text,
            "id": call_id,
            "error": f"not a complete call: {exc}",
            "type": "invalid_tool_call",
        }
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
            out, self._sent = self._text[self._sent :], len(self._text)
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


def function_spec(tool: Any, where: str = "tools[0]") -> dict[str, Any]:
    """{"name", "description", "parameters"} of an OpenAI function tool ({"type": "function", "function": {...}})."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(where, f'must be {{"type": "function", "function": {{"name": ...}}}}, got {tool!r}')
    fn = tool["function"]
    extra = sorted(set(tool) - {"type", "function"}) or sorted(
        set(fn) - {"name", "description", "parameters", "strict"}
    )
    if extra:
        raise ToolError(where, f"has unknown field(s) {extra}")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ToolError(f"{where}.function.name", f"must be 1-64 letters, digits, _ or -, got {name!r}")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description", f"must be a string, got {description!r}")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters", f"must be a JSON schema object, got {params!r}")
    return {"name": name, "description": description, "parameters": params}


def choice_of(choice: Any, names: Sequence[str]) -> str:
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
    raise ToolError(
        "tool_choice", f"must be 'auto', 'any', 'required', 'none' or the name of a tool {list(names)}, got {choice!r}"
    )


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, "arguments": strict_schema(tool["parameters"])},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def strict_schema(schema: Any) -> Any:
    """A copy of schema in which every object that lists its properties and says nothing about others allows no
    other keys (`"additionalProperties": false`). Pydantic and TypedDict schemas leave that open, and a small
    model under a grammar that allows extra keys may invent some; an explicit choice in the schema is kept."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: strict_schema(value) if key not in ("enum", "const", "default", "examples") else value
        for key, value in schema.items()
    }
    if "properties" in out and "additionalProperties" not in out and out.get("type", "object") == "object":
        out["additionalProperties"] = False
    return out
