"""Chat messages: the one validator (batch files, the LangChain adapter and chat templates all use it) and
`apply_chat_template`.

A message is an OpenAI chat message restricted to what a text model's chat template can render:

  * ``role``: ``system``, ``developer`` (OpenAI's newer name for the system turn; rendered as ``system``),
    ``user``, ``assistant`` or ``tool``;
  * ``content``: a string, or a list of text parts ``{"type": "text", "text": ...}``, which are joined;
  * optional ``tool_calls`` on assistant messages and ``tool_call_id`` on tool messages (passed to the template);
  * optional ``name`` (a participant's name) on system, developer, user and assistant messages: passed to the chat
    template as ``message.name``; a template that reads it renders it, the others (the default model's, SmolLM2's)
    ignore it, so it changes nothing there.

Anything else (other part types such as ``image_url`` or ``input_audio``, other roles, other keys) is a
MessageError that names where it is (``messages[2].content[0]``) and what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError, InvalidParameterError

__all__ = ["ROLES", "MessageError", "apply_chat_template", "validate_messages"]

ROLES = ("system", "developer", "user", "assistant", "tool")
# Chat templates know "system", and not all of them know "developer".
_RENDERED_ROLE = {"developer": "system"}
# Keys a message may carry besides role and content, by role.
_OPTIONAL_KEYS = {
    "system": ("name",),
    "developer": ("name",),
    "user": ("name",),
    "assistant": ("name", "tool_calls"),
    "tool": ("tool_call_id",),
}
_TEXT_PART = '{"type": "text", "text": ...}'


class MessageError(ChatTemplateError, InvalidParameterError):
    """A chat message that cannot be rendered. `param` locates it (``messages[2].content[0]``), `problem` says why;
    `unsupported_field` is True for a key that is not accepted (rather than a bad value)."""

    def __init__(self, param: str, problem: str, *, unsupported_field: bool = False) -> None:
        super().__init__(f"{param}: {problem}")
        self.param = param
        self.problem = problem
        self.unsupported_field = unsupported_field


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks chat messages and returns them as a chat template takes them: string content, developer -> system.

    Raises MessageError (a ChatTemplateError and an InvalidParameterError) at the first problem.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise MessageError(
            "messages",
            f"must be a non-empty list of messages ({{'role': ..., 'content': ...}} objects), "
            f"got {type(messages).__name__}",
        )
    return [_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _message(where: str, msg: Any) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise MessageError(where, f"each message must be an object with role and content, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise MessageError(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {role!r}")
    optional = _OPTIONAL_KEYS.get(role, ())
    for key in msg:
        if key not in ("role", "content", *optional):
            supported = ", ".join(("role", "content", *optional))
            raise MessageError(
                f"{where}.{key}",
                f"unsupported message field for a {role} message (supported: {supported})",
                unsupported_field=True,
            )
    out: dict[str, Any] = {"role": _RENDERED_ROLE.get(role, role)}
    if "name" in msg:
        if not isinstance(msg["name"], str) or not msg["name"]:
            raise MessageError(f"{where}.name", f"must be a non-empty string, got {msg['name']!r}")
        out["name"] = msg["name"]
    if "tool_calls" in msg:
        out["tool_calls"] = _tool_calls(f"{where}.tool_calls", msg["tool_calls"])
    if "tool_call_id" in msg:
        if not isinstance(msg["tool_call_id"], str) or not msg["tool_call_id"]:
            raise MessageError(f"{where}.tool_call_id", f"must be a non-empty string, got {msg['tool_call_id']!r}")
        out["tool_call_id"] = msg["tool_call_id"]
    content = msg.get("content")
    # An assistant turn that only calls tools has no content (OpenAI sends null).
    out["content"] = "" if content is None and "tool_calls" in out else _content(f"{where}.content", content)
    return out


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(
            where, f"must be a string or a list of text parts {_TEXT_PART}, got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise MessageError(at, f"each content part must be an object {_TEXT_PART}, got {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise MessageError(
                at,
                f"content parts of type {kind!r} are not supported; the models here take text parts {_TEXT_PART} only",
            )
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise MessageError(
                f"{at}.{extra[0]}", "unsupported content-part field (supported: type, text)", unsupported_field=True
            )
        if not isinstance(part.get("text"), str):
            raise MessageError(f"{at}.text", f"must be a string, got {type(part.get('text')).__name__}")
        texts.append(part["text"])
    # Joined with "": the parts are consecutive pieces of one message's text, and OpenAI's API inserts no
    # separator between them either; a client that wants a line break between parts puts it in the text.
    return "".join(texts)


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """OpenAI's shape: [{"id": str, "type": "function", "function": {"name": str, "arguments": str}}]."""
    if not isinstance(calls, list) or not calls:
        raise MessageError(where, f"must be a non-empty list of tool calls, got {calls!r}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise MessageError(
                at, 'must be an object {"id": ..., "type": "function", "function": {"name", "arguments"}}'
            )
        if call.get("type", "function") != "function":
            raise MessageError(f"{at}.type", f'only "function" tool calls are supported, got {call.get("type")!r}')
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise MessageError(f"{at}.function.{key}", f"must be a string, got {type(function.get(key)).__name__}")
    return [dict(call) for call in calls]


def apply_chat_template(tokenizer: Any, messages: Any, *, model_name: str) -> list[int]:
    """Token ids of the messages in the model's chat template, ending with the assistant generation prompt.

    Raises ChatTemplateError (MessageError for malformed messages) when they cannot be formatted.
    """
    rendered = validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"model {model_name!r} has no chat template, so chat messages cannot be formatted for it; "
            "send a plain text prompt instead, or use a chat/instruct model"
        )
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 TemplateError, raise_exception() inside templates, ...
        raise ChatTemplateError(
            f"model {model_name!r}: its chat template rejected the messages: {type(exc).__name__}: {exc}"
        ) from exc
    # The template writes the special tokens (e.g. <|im_start|>) itself: add none.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
