"""Structured output and tool calls through the LangChain adapters: what reaches the core (the response_format,
the tools in the prompt), how answers are parsed (tool_calls with ids, streamed tool_call_chunks, parsed
objects), against the fake decoder; then, marked slow, on the real default model."""

from __future__ import annotations

import json
from typing import TypedDict

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_spec import ChatSpeculative, SpeculativeLLM
from langchain_spec.tools import CallStream, ToolPlan, call_text
from spec_batch import InvalidParameterError


@tool
def magic_function(input: int) -> int:
    """Apply a magic function to an input."""
    return input + 2


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "sunny"


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name")
    age: int


class PersonDict(TypedDict):
    name: str
    age: int


CALL = call_text("magic_function", {"input": 3})
PERSON_JSON = '{"name": "Ada", "age": 36}'


def replying(fake, text: str):
    fake.REPLY = text
    return fake


def sent_format(fake) -> dict | None:
    """The response_format of the last request that reached the core (parsed once there), as its OpenAI dict."""
    calls = fake.stream_calls or [(None, p) for _, p in fake.generate_calls]
    fmt = calls[-1][1].response_format
    return None if fmt is None else fmt.to_dict()


# ---------------------------------------------------------------- response_format


@pytest.mark.parametrize("cls", [SpeculativeLLM, ChatSpeculative])
def test_response_format_as_a_constructor_or_call_argument(cls, fake_decoder):
    choice = {"type": "choice", "choices": ["yes", "no"]}
    model = cls(decoder=replying(fake_decoder, "yes"), response_format=choice)
    model.invoke("Is it?")
    assert sent_format(fake_decoder) == choice
    regex = {"type": "regex", "pattern": "[0-9]+"}
    model.invoke("How many?", response_format=regex)
    assert sent_format(fake_decoder) == regex
    model.invoke("Anything", response_format={"type": "text"})
    assert sent_format(fake_decoder) is None


@pytest.mark.parametrize("cls", [SpeculativeLLM, ChatSpeculative])
def test_a_bad_response_format_fails_before_the_core(cls, fake_decoder):
    with pytest.raises(ValueError, match="response_format.pattern"):  # pydantic's ValidationError at construction
        cls(decoder=fake_decoder, response_format={"type": "regex", "pattern": "a["})
    with pytest.raises(InvalidParameterError, match="unclosed character class"):
        cls(decoder=fake_decoder).invoke("x", response_format={"type": "regex", "pattern": "a["})
    assert fake_decoder.stream_calls == []


def test_the_llm_does_not_take_tools(fake_decoder):
    with pytest.raises(InvalidParameterError, match="ChatSpeculative.bind_tools"):
        SpeculativeLLM(decoder=fake_decoder).invoke("x", tools=[magic_function])


# ---------------------------------------------------------------- tools: prompt, grammar, parsing


def test_bind_tools_describes_the_tools_and_constrains_the_answer_to_a_call(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, CALL))
    msg = chat.bind_tools([magic_function, get_weather], tool_choice="any").invoke("magic_function(3)?")
    system = fake_decoder.templates[-1][0]
    assert system["role"] == "system" and "magic_function" in system["content"] and "get_weather" in system["content"]
    schema = sent_format(fake_decoder)["json_schema"]["schema"]
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["magic_function", "get_weather"]
    args = schema["anyOf"][0]["properties"]["arguments"]
    assert args["required"] == ["input"] and args["additionalProperties"] is False
    assert msg.content == "" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "magic_function" and call["args"] == {"input": 3} and call["id"].startswith("call_")
    jsonschema.validate(json.loads(CALL), schema)


def test_tool_choice_forms(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, "Hi."))
    tools = [magic_function, get_weather]
    chat.bind_tools(tools, tool_choice="get_weather").invoke("x")
    assert [c["properties"]["name"]["const"] for c in sent_format(fake_decoder)["json_schema"]["schema"]["anyOf"]] == [
        "get_weather"
    ]
    chat.bind_tools(tools, tool_choice={"type": "function", "function": {"name": "magic_function"}}).invoke("x")
    assert "magic_function" in json.dumps(sent_format(fake_decoder)) and "get_weather" not in json.dumps(
        sent_format(fake_decoder)
    )
    msg = chat.bind_tools(tools).invoke("x")  # auto: text or a call
    assert sent_format(fake_decoder)["type"] == "lark" and msg.content == "Hi." and msg.tool_calls == []
    chat.bind_tools(tools, tool_choice="none").invoke("x")
    assert sent_format(fake_decoder) is None and fake_decoder.templates[-1] == [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidParameterError, match="tool_choice must be"):
        chat.bind_tools(tools, tool_choice="nonexistent")
    with pytest.raises(InvalidParameterError, match="not both"):
        chat.bind_tools(tools, tool_choice="any").invoke("x", response_format={"type": "json_object"})


def test_a_call_cut_by_max_tokens_is_an_invalid_tool_call(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, CALL), max_tokens=len(CALL) - 5)
    msg = chat.bind_tools([magic_function], tool_choice="any").invoke("x")
    assert msg.tool_calls == [] and msg.response_metadata["finish_reason"] == "length"
    (bad,) = msg.invalid_tool_calls
    assert (
        bad["name"] == "magic_function"
        and bad["args"] == CALL[: len(CALL) - 5][len('{"name": "magic_function", "arguments": ') :]
    )


@pytest.mark.parametrize("reply", [CALL, "Just text.", call_text("magic_function", {"input": {"deep": "}"}})])
def test_streamed_answers_add_up_to_the_invoked_message(fake_decoder, reply):
    chat = ChatSpeculative(decoder=replying(fake_decoder, reply)).bind_tools([magic_function])
    full = None
    chunks = list(chat.stream("x"))
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    whole = chat.invoke("x")
    assert full.content == whole.content
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    if reply.startswith("{"):
        assert len(chunks) > 2 and all(c.content == "" for c in chunks)  # the arguments arrive piece by piece
        assert full.tool_calls[0]["id"] == full.tool_call_chunks[0]["id"]


def test_call_stream_piece_by_piece():
    stream, out = CallStream(), []
    for i, ch in enumerate(CALL):
        out.append(stream.feed(ch, final=i == len(CALL) - 1))
    assert "".join(content for content, _ in out) == ""
    chunks = [c for _, cs in out for c in cs]
    assert chunks[0]["name"] == "magic_function" and all(c["name"] is None for c in chunks[1:])
    assert "".join(c["args"] for c in chunks) == '{"input": 3}'


def test_tool_histories_go_into_the_chat_template(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, "It is 5.")).bind_tools([magic_function])
    history = [
        HumanMessage("magic_function(3)?"),
        AIMessage(
            [
                {"type": "text", "text": "Let me see."},
                {"type": "tool_use", "id": "c1", "name": "magic_function", "input": {"input": 3}},
            ],
            tool_calls=[{"name": "magic_function", "args": {"input": 3}, "id": "c1", "type": "tool_call"}],
        ),
        ToolMessage("5", tool_call_id="c1"),
    ]
    assert chat.invoke(history).content == "It is 5."
    rendered = fake_decoder.templates[-1]
    assert rendered[0]["role"] == "system"
    assert rendered[2] == {
        "role": "assistant",
        "content": "Let me see.\n" + CALL,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "magic_function", "arguments": '{"input": 3}'}}
        ],
    }
    assert rendered[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}


def test_a_batch_with_tools_is_one_call_of_the_core(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, CALL)).bind_tools([magic_function], tool_choice="any")
    msgs = chat.batch(["a", "b", "c"])
    assert len(fake_decoder.generate_calls) == 1 and fake_decoder.stream_calls == []
    assert all(m.tool_calls[0]["args"] == {"input": 3} for m in msgs)
    assert len({m.tool_calls[0]["id"] for m in msgs}) == 3


def test_tool_plan_of_a_tool_without_arguments():
    @tool
    def ping() -> str:
        """Ping."""
        return "pong"

    plan = ToolPlan.from_kwargs({"tools": [ping], "tool_choice": "any"})
    args = plan.response_format()["json_schema"]["schema"]["anyOf"][0]["properties"]["arguments"]
    assert args == {"type": "object", "properties": {}, "additionalProperties": False}


# ---------------------------------------------------------------- with_structured_output


@pytest.mark.parametrize(
    "schema, expected",
    [
        (Person, Person(name="Ada", age=36)),
        (PersonDict, {"name": "Ada", "age": 36}),
        (Person.model_json_schema(), {"name": "Ada", "age": 36}),
    ],
)
def test_with_structured_output_parses_under_a_strict_schema(fake_decoder, schema, expected):
    chat = ChatSpeculative(decoder=replying(fake_decoder, PERSON_JSON))
    assert chat.with_structured_output(schema).invoke("Ada, 36") == expected
    fmt = sent_format(fake_decoder)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["additionalProperties"] is False
    assert set(fmt["json_schema"]["schema"]["properties"]) == {"name", "age"}


def test_json_mode_and_function_calling_and_include_raw(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, PERSON_JSON))
    assert chat.with_structured_output(None, method="json_mode").invoke("x") == {"name": "Ada", "age": 36}
    assert sent_format(fake_decoder) == {"type": "json_object"}
    assert chat.with_structured_output(Person, method="json_mode").invoke("x") == Person(name="Ada", age=36)
    assert sent_format(fake_decoder)["type"] == "json_schema"
    loose = chat.with_structured_output(PersonDict, strict=False)
    loose.invoke("x")
    assert "additionalProperties" not in sent_format(fake_decoder)["json_schema"]["schema"]
    replying(fake_decoder, call_text("Person", {"name": "Ada", "age": 36}))
    assert chat.with_structured_output(Person, method="function_calling").invoke("x") == Person(name="Ada", age=36)
    raw = chat.with_structured_output(Person, method="function_calling", include_raw=True).invoke("x")
    assert (
        isinstance(raw["raw"], AIMessage)
        and raw["parsed"] == Person(name="Ada", age=36)
        and raw["parsing_error"] is None
    )
    replying(fake_decoder, '{"name": "Ada"')  # cut short: the parser's error is reported, not raised
    raw = chat.with_structured_output(Person, include_raw=True).invoke("x")
    assert raw["parsed"] is None and raw["parsing_error"] is not None
    with pytest.raises(InvalidParameterError, match="method must be one of"):
        chat.with_structured_output(Person, method="xml")


# ---------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def real_chat():
    return ChatSpeculative(target="default", draft="ngram", max_tokens=64, temperature=0)


@pytest.mark.slow
def test_real_model_forced_tool_call(real_chat):
    msg = real_chat.bind_tools([magic_function], tool_choice="any").invoke("What is magic_function(3)? Use the tool.")
    assert msg.tool_calls[0]["name"] == "magic_function" and set(msg.tool_calls[0]["args"]) == {"input"}
    assert msg.response_metadata["speculative_stats"]["forced_tokens"] > 0


@pytest.mark.slow
def test_real_model_structured_output_validates(real_chat):
    person = real_chat.with_structured_output(Person).invoke("Extract the person: Ada Lovelace was 36 years old.")
    assert isinstance(person, Person)


@pytest.mark.slow
def test_real_model_llm_choice(fake_decoder):
    llm = SpeculativeLLM(
        target="default",
        draft="ngram",
        max_tokens=8,
        response_format={"type": "choice", "choices": ["positive", "negative"]},
    )
    assert llm.invoke("Review: I loved this film, it was wonderful.\nSentiment:") in ("positive", "negative")


# ---------------------------------------------------------------- the schema itself


class Node(BaseModel):
    """A tree."""

    name: str
    kids: list[Node] | None = None


TREE = '{"name": "a", "kids": [{"name": "b", "kids": null}]}'


def _consumed(response_format: dict, text: str) -> tuple[int, bool]:
    """How many bytes of text the response_format's grammar takes, and whether it then accepts."""
    from llguidance import LLMatcher

    from spec_batch.core.structured.response_format import _byte_tokenizer, parse_response_format

    matcher = LLMatcher(_byte_tokenizer(), parse_response_format(response_format).grammar(), log_level=0)
    data = list(text.encode())
    n = matcher.try_consume_tokens(data)
    return n, n == len(data) and matcher.is_accepting()


def test_a_recursive_model_is_constrained_at_every_depth_and_parses(fake_decoder):
    chat = ChatSpeculative(decoder=replying(fake_decoder, TREE))
    tree = chat.with_structured_output(Node).invoke("a tree")
    assert tree == Node(name="a", kids=[Node(name="b", kids=None)])
    fmt = sent_format(fake_decoder)
    schema = fmt["json_schema"]["schema"]
    assert fmt["json_schema"]["name"] == "Node" and schema["$defs"]["Node"]["additionalProperties"] is False
    assert _consumed(fmt, TREE) == (len(TREE), True)
    nested_bad = '{"name": "a", "kids": [{"nam'  # a nested object must be a Node too
    assert _consumed(fmt, '{"name": "a", "kids": [{"oops": 1}]}')[0] == len('{"name": "a", "kids": [{"')
    assert _consumed(fmt, nested_bad)[0] == len(nested_bad)
    deep = '{"name": "a", "kids": [{"name": "b", "kids": [{"name": "c", "kids": [{"x": 1}]}]}]}'
    assert _consumed(fmt, deep)[0] == deep.index('{"x"') + 2


def test_a_schema_dict_needs_no_title(fake_decoder):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    chat = ChatSpeculative(decoder=replying(fake_decoder, PERSON_JSON))
    assert chat.with_structured_output(schema).invoke("x") == {"name": "Ada", "age": 36}
    fmt = sent_format(fake_decoder)
    assert fmt["json_schema"]["name"] == "output" and fmt["json_schema"]["schema"]["required"] == ["name", "age"]
    replying(fake_decoder, call_text("output", {"name": "Ada", "age": 36}))
    assert chat.with_structured_output(schema, method="function_calling").invoke("x") == {"name": "Ada", "age": 36}


@pytest.mark.parametrize(
    "schema, needle",
    [
        ({"title": "X", "type": "objekt"}, "Invalid type: objekt"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a&&b]"}}, "required": ["a"]},
            "unsatisfiable",
        ),
    ],
)
def test_an_invalid_schema_raises_before_the_core(fake_decoder, schema, needle):
    chat = ChatSpeculative(decoder=fake_decoder)
    with pytest.raises(InvalidParameterError, match=needle):
        chat.with_structured_output(schema)
    assert fake_decoder.stream_calls == [] and fake_decoder.generate_calls == []


# ---------------------------------------------------------------- grammars that match nothing (item 4)


@pytest.mark.parametrize("cls", [SpeculativeLLM, ChatSpeculative])
@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "regex", "pattern": "[a&&b]"},
        {"type": "regex", "pattern": r"[^\s\S]"},
        {"type": "lark", "grammar": "start: /[a&&b]/"},
    ],
)
def test_a_grammar_that_matches_nothing_is_refused(cls, fake_decoder, fmt):
    with pytest.raises(InvalidParameterError, match="matches no string at all"):
        cls(decoder=fake_decoder).invoke("x", response_format=fmt)
    with pytest.raises(ValueError, match="matches no string at all"):
        cls(decoder=fake_decoder, response_format=fmt)
    assert fake_decoder.stream_calls == [] and fake_decoder.generate_calls == []


# ---------------------------------------------------------------- OpenAI's limits (item 6)


@pytest.mark.parametrize("cls", [SpeculativeLLM, ChatSpeculative])
@pytest.mark.parametrize(
    "field, value", [("temperature", 2.5), ("temperature", 100), ("top_p", 0), ("seed", 2**63), ("seed", -(2**63) - 1)]
)
def test_parameter_limits_are_openais(cls, fake_decoder, field, value):
    with pytest.raises(ValueError, match=field):
        cls(decoder=fake_decoder, **{field: value})
    with pytest.raises(InvalidParameterError, match=f"{field} must be"):
        cls(decoder=fake_decoder).invoke("x", **{field: value})
    ok = {"temperature": 2, "top_p": 1, "seed": -(2**63)}[field]
    cls(decoder=fake_decoder, **{field: ok}).invoke("x")


@pytest.mark.slow
def test_real_model_recursive_structured_output_parses():
    chat = ChatSpeculative(target="default", draft="ngram", max_tokens=200, temperature=0)
    tree = chat.with_structured_output(Node).invoke("A tree: root 'a' with one child 'b' that has no children.")
    assert isinstance(tree, Node)
