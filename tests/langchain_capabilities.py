"""ChatSpeculative's capability flags for LangChain's standard suites, declared once for the unit and the
integration suite. Tool calls, tool choice, structured output and JSON mode are decoded under a grammar
(docs/structured-output.md); image, audio and PDF inputs and a per-call model override are not offered."""

from __future__ import annotations

from langchain_spec import ChatSpeculative


class SpeculativeCapabilities:
    @property
    def chat_model_class(self) -> type[ChatSpeculative]:
        return ChatSpeculative

    has_tool_calling = property(lambda self: True)
    has_tool_choice = property(lambda self: True)
    has_structured_output = property(lambda self: True)
    supports_json_mode = property(lambda self: True)
    returns_usage_metadata = property(lambda self: True)
    supports_image_inputs = property(lambda self: False)
    supports_image_urls = property(lambda self: False)
    supports_pdf_inputs = property(lambda self: False)
    supports_audio_inputs = property(lambda self: False)
    supports_image_tool_message = property(lambda self: False)
    supports_pdf_tool_message = property(lambda self: False)
    supports_anthropic_inputs = property(lambda self: False)
    # One target per instance; a per-call `model=` is an error rather than silently ignored.
    supports_model_override = property(lambda self: False)
