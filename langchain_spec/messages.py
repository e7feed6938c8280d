"""LangChain messages -> the chat messages of spec-batch's one chat-message validator (ChatSpeculative's input)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

from spec_batch.loading import MessageError, validate_messages

from .tools import call_text


class UnsupportedMessageError(MessageError):
    """A message ChatSpeculative cannot put into the chat template (images, tool calls, unknown roles or types)."""


def messages_to_dicts(messages: Sequence[BaseMessage], *, calls_in_content: bool = True) -> list[dict[str, Any]]:
    """LangChain messages -> chat messages, checked by spec-batch's one chat-message validator.

    system -> "system", human -> "user", ai -> "assistant", tool -> "tool" (with its tool_call_id), ChatMessage ->
    its own role (which must be a chat role). Content must be text (a string, or text blocks, which are joined);
    a `name` is ignored. An AIMessage's tool calls go along as OpenAI `tool_calls`, and, for templates that do
    not render those (calls_in_content), also as the JSON the model writes for a call, after its text.
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        extra: dict[str, Any] = {}
        content = message.content
        if isinstance(message, ChatMessage):
            role = message.role
        elif isinstance(message, SystemMessage):
            role = "system"
        elif isinstance(message, HumanMessage):
            role = "user"
        elif isinstance(message, AIMessage):
            role = "assistant"
            if message.tool_calls:
                content, extra = _with_calls(message, calls_in_content)
        elif isinstance(message, ToolMessage):
            role = "tool"
            extra = {"tool_call_id": message.tool_call_id}
        else:
            raise UnsupportedMessageError(
                f"messages[{i}]",
                f"is a {type(message).__name__}; ChatSpeculative accepts system, human, AI, tool and chat messages",
            )
        out.append({"role": role, "content": _as_parts(content), **extra})
    try:
        return validate_messages(out)
    except MessageError as exc:
        raise UnsupportedMessageError(exc.param, exc.problem, unsupported_field=exc.unsupported_field) from None


def _with_calls(message: AIMessage, calls_in_content: bool) -> tuple[str | list[Any], dict[str, Any]]:
    """An AIMessage's content without its tool-use blocks (the calls are in tool_calls), and its calls."""
    content: str | list[Any] = message.content
    if isinstance(content, list):  # Anthropic-style content repeats each call as a tool_use block
        content = [b for b in content if not (isinstance(b, dict) and b.get("type") in ("tool_use", "tool_call"))]
    calls = [
        {
            "id": c.get("id") or "",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)},
        }
        for c in message.tool_calls
    ]
    if calls_in_content:
        written = "\n".join(call_text(c["name"], c["args"]) for c in message.tool_calls)
        text = (
            content
            if isinstance(content, str)
            else "".join(b if isinstance(b, str) else str(b.get("text", "")) for b in content)
        )
        content = f"{text}\n{written}" if text else written
    return content, {"tool_calls": calls}


def _as_parts(content: str | list[Any]) -> str | list[Any]:
    """LangChain content in OpenAI's form: bare strings become text parts, and text blocks lose LangChain's own
    keys (id, index, annotations); other blocks pass unchanged, for the validator to name."""
    if isinstance(content, str):
        return content
    parts: list[Any] = []
    for block in content:
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append({"type": "text", "text": block.get("text")})
        else:
            parts.append(block)
    return parts
