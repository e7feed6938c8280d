"""Chat messages (spec_batch.loading.chat): the one validator, the chat template, and the batch-file parser using
them, so that what passes validation is what the template renders."""

from __future__ import annotations

import json

import pytest
import torch

from spec_batch.errors import ChatTemplateError, InvalidParameterError
from spec_batch.jobs.batch_input import CHAT, INVALID_VALUE, BatchLineError, parse_line
from spec_batch.loading import MessageError, build_decoder, validate_messages
from spec_batch.loading.chat import apply_chat_template
from spec_batch.loading.load import load_model

# ------------------------------------------------------------------ the validator


def test_roles_content_parts_and_tool_fields_are_normalized():
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": []},
    ]
    assert validate_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "two parts"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": ""},
    ]
    assert validate_messages(tuple(messages[:1])) == [{"role": "system", "content": "Be brief."}]


@pytest.mark.parametrize(
    ("messages", "param", "why", "unsupported_field"),
    [
        ([], "messages", "non-empty list", False),
        ("hello", "messages", "non-empty list", False),
        ({"role": "user", "content": "hi"}, "messages", "non-empty list", False),
        ([["user", "hi"]], "messages[0]", "object with role and content", False),
        ([{"role": "user", "content": "a"}, {"role": "bot", "content": "hi"}], "messages[1].role", "got 'bot'", False),
        ([{"content": "hi"}], "messages[0].role", "got None", False),
        ([{"role": "user", "content": 3}], "messages[0].content", "string or a list of text parts", False),
        ([{"role": "user"}], "messages[0].content", "got NoneType", False),
        (
            [{"role": "user", "content": "hi", "temperature": 1}],
            "messages[0].temperature",
            "unsupported message field",
            True,
        ),
        ([{"role": "tool", "content": "1", "name": "ann"}], "messages[0].name", "supported: role, content, tool", True),
        ([{"role": "user", "content": "hi", "name": ""}], "messages[0].name", "non-empty string", False),
        ([{"role": "user", "content": "hi", "tool_calls": []}], "messages[0].tool_calls", "unsupported", True),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
            "messages[0].content[1]",
            "type 'image_url' are not supported",
            False,
        ),
        (
            [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            ],
            "messages[1].content[0]",
            "type 'input_audio' are not supported",
            False,
        ),
        ([{"role": "user", "content": ["bare string"]}], "messages[0].content[0]", "must be an object", False),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text", "string", False),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}],
            "messages[0].content[0].cache_control",
            "unsupported content-part field",
            True,
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": "f()"}],
            "messages[0].tool_calls",
            "non-empty list",
            False,
        ),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
            "messages[0].tool_calls[0].function.arguments",
            "string",
            False,
        ),
        (
            [{"role": "assistant", "tool_calls": [{"type": "custom", "function": {"name": "f", "arguments": "{}"}}]}],
            "messages[0].tool_calls[0].type",
            "function",
            False,
        ),
        ([{"role": "tool", "content": "1", "tool_call_id": ""}], "messages[0].tool_call_id", "non-empty string", False),
        ([{"role": "assistant", "content": None}], "messages[0].content", "got NoneType", False),
    ],
)
def test_malformed_messages_name_where_and_why(messages, param, why, unsupported_field):
    with pytest.raises(MessageError) as exc:
        validate_messages(messages)
    err = exc.value
    assert err.param == param and why in err.problem
    assert str(err) == f"{param}: {err.problem}"
    assert err.unsupported_field is unsupported_field
    # Both error families of the project: a chat-template error and a bad parameter.
    assert isinstance(err, ChatTemplateError) and isinstance(err, InvalidParameterError)


# ------------------------------------------------------------------ the chat template


def test_chat_template_appends_generation_prompt(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = apply_chat_template(tiny_tokenizer, messages, model_name="tiny")
    assert all(isinstance(i, int) for i in ids)
    text = tiny_tokenizer.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_developer_and_text_parts_render_as_system_and_joined_text(tiny_tokenizer):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    openai_style = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
    ]
    assert apply_chat_template(tiny_tokenizer, openai_style, model_name="tiny") == apply_chat_template(
        tiny_tokenizer, plain, model_name="tiny"
    )


def test_tokenizer_without_chat_template_is_a_clear_error(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="model 'plain-model' has no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}], model_name="plain-model")


def test_malformed_messages_fail_before_the_template(tiny_tokenizer):
    with pytest.raises(MessageError, match=r"messages\[0\]\.role: .*got 'bot'"):
        apply_chat_template(tiny_tokenizer, [{"role": "bot", "content": "hi"}], model_name="tiny")


def test_template_errors_become_chat_template_errors(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="'strict'.*roles must alternate"):
        apply_chat_template(tok, [{"role": "user", "content": "x"}], model_name="strict")


# ------------------------------------------------------------------ through the batch-file parser


def _chat_line(messages: object) -> str:
    return json.dumps({"custom_id": "r1", "method": "POST", "url": CHAT, "body": {"messages": messages}})


@pytest.fixture(scope="module")
def tiny_decoder_with_template(tiny_dir):
    """A decoder whose chat template is the real one, as the runner uses it at decode time."""
    loaded = load_model(tiny_dir)
    return build_decoder(loaded.model, loaded.tokenizer, target_name="tiny", draft="none", device=torch.device("cpu"))


def test_batch_line_with_developer_message_decodes(tiny_decoder_with_template, tiny_tokenizer):
    """The defect: a developer message passed the batch-file check, then failed at decode time as
    chat_template_error. Now the parser's prompt is exactly what the decoder's template takes."""
    req = parse_line(_chat_line([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]), 1)
    assert req.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tiny_decoder_with_template.apply_chat_template(req.prompt)
    assert tiny_tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_batch_line_with_text_parts_decodes(tiny_decoder_with_template, tiny_tokenizer):
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    req = parse_line(_chat_line([{"role": "system", "content": parts[:1]}, {"role": "user", "content": parts}]), 1)
    assert req.prompt == [{"role": "system", "content": "What is "}, {"role": "user", "content": "What is 2+2?"}]
    ids = tiny_decoder_with_template.apply_chat_template(req.prompt)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in tiny_tokenizer.decode(ids)


def test_batch_line_with_tool_turns_is_accepted():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
    ]
    assert parse_line(_chat_line(messages), 1).prompt == validate_messages(messages)


@pytest.mark.parametrize(
    ("messages", "code", "param", "words"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            INVALID_VALUE,
            "body.messages[0].content[0]",
            "'image_url'",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}],
            INVALID_VALUE,
            "body.messages[1].role",
            "'critic'",
        ),
        ([{"role": "user", "content": "a", "name": 3}], INVALID_VALUE, "body.messages[0].name", "non-empty string"),
    ],
)
def test_batch_line_message_errors_name_the_part_and_message(messages, code, param, words):
    with pytest.raises(BatchLineError) as exc:
        parse_line(_chat_line(messages), 7)
    err = exc.value
    assert (err.code, err.param, err.custom_id) == (code, param, "r1")
    assert err.message.startswith(f"{param}: ") and words in err.message
