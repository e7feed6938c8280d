"""generate()'s inputs: one SamplingParams per prompt; prompt ids checked against the vocabulary and context."""

from __future__ import annotations

import pytest

from spec_batch import InvalidParameterError, PromptTooLongError, SamplingParams
from spec_batch.core.inputs import params_list, prompt_ids


def test_params_list():
    p = SamplingParams(max_new_tokens=3)
    assert params_list(None, 2) == [SamplingParams(), SamplingParams()]
    assert params_list(p, 3) == [p, p, p]
    assert params_list([p, SamplingParams()], 2) == [p, SamplingParams()]
    with pytest.raises(InvalidParameterError, match="got 1 SamplingParams for 2 prompts"):
        params_list([p], 2)


def _ids(prompt, max_new_tokens=4, tokenizer=None, index=7):
    return prompt_ids(
        prompt,
        SamplingParams(max_new_tokens=max_new_tokens),
        index,
        tokenizer=tokenizer,
        vocab_size=64,
        max_context=16,
        model_name="tiny",
    )


def test_prompt_ids(fake_tokenizer):
    assert _ids("3 14 15", tokenizer=fake_tokenizer) == [3, 14, 15]
    assert _ids([0, 63]) == [0, 63]
    assert _ids([1] * 12, max_new_tokens=4) == [1] * 12  # exactly the context


@pytest.mark.parametrize(
    "prompt,error,message",
    [
        ([1, 64], InvalidParameterError, r"prompt 7: token id 64 is outside the vocabulary \(0..63\)"),
        ([], InvalidParameterError, "prompt 7 is empty"),
        ([True], InvalidParameterError, "prompt 7: expected a string or a list of token ids, got list"),
        (None, InvalidParameterError, "got NoneType"),
        (
            [1] * 13,
            PromptTooLongError,
            "prompt 7 has 13 tokens; with max_new_tokens=4 it needs 17 positions but 'tiny' has a context of 16",
        ),
    ],
)
def test_prompt_errors_name_the_prompt(prompt, error, message):
    with pytest.raises(error, match=message) as caught:
        _ids(prompt)
    assert caught.value.prompt_index == 7  # a field, so callers never parse the message
    detail = caught.value.detail  # the same message of "the prompt", for callers that name it by its line
    assert "prompt 7" not in detail and str(caught.value).endswith(detail.removeprefix("the prompt"))
