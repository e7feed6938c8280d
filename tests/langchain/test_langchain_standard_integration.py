"""LangChain's standard chat model integration tests (langchain-tests 1.1.9): ChatSpeculative on the real core and
the default model (SmolLM2-135M-Instruct, n-gram drafter, CPU).

Features the model does not offer are declared off below, and the suite then skips their tests by itself
(tool calling, tool choice, structured output, JSON mode, image/audio/PDF inputs, model override, VCR
recordings). Nothing is marked xfail: every test of a feature the model offers runs and passes.
"""
from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_spec import ChatSpeculative

pytestmark = pytest.mark.slow


class TestChatSpeculativeIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpeculative]:
        return ChatSpeculative

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Short answers keep the suite quick on a CPU; every check of the suite still applies to them.
        return {"target": "default", "draft": "ngram", "max_tokens": 12, "temperature": 0}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        # One target per instance; a per-call `model=` is an error rather than silently ignored.
        return False
