"""LangChain's standard chat model unit tests (langchain-tests 1.1.9) against ChatSpeculative. No model is loaded."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_capabilities import SpeculativeCapabilities
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import ValidationError

from langchain_spec import ChatSpeculative


class TestChatSpeculativeUnit(SpeculativeCapabilities, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"target": "default", "draft": "ngram"}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # The suite's standard parameters are those of a hosted API. A local model has no API key and no network
        # request to retry, and spec-batch makes parameters it cannot honour errors rather than ignoring them
        # (test_api_parameters_are_rejected below). temperature, max_tokens, timeout and stop stay.
        params = dict(super().standard_chat_model_params)
        params.pop("api_key")
        params.pop("max_retries")
        return params


@pytest.mark.parametrize("param", [{"api_key": "test"}, {"max_retries": 2}])
def test_api_parameters_are_rejected(param):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ChatSpeculative(**param)
