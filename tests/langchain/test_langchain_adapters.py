"""The LangChain adapters' own logic, against the fake decoder of tests/conftest.py (fast; no model).

The real core on the default model is exercised in test_langchain_real.py and the standard suites.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from pydantic import ValidationError

import langchain_spec
from langchain_spec import ChatSpeculative, GenerationTimeout, SpeculativeLLM, UnsupportedMessageError
from spec_batch import ChatTemplateError, InvalidParameterError, PromptTooLongError, SamplingParams, loading
from spec_batch.loading import factory


def wait_until(condition, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.starts = 0
        self.ends = 0
        self.errors: list[BaseException] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_start(self, *args: Any, **kwargs: Any) -> None:
        self.starts += 1

    def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
        self.starts += 1

    def on_llm_end(self, *args: Any, **kwargs: Any) -> None:
        self.ends += 1

    def on_llm_error(self, error: BaseException, **kwargs: Any) -> None:
        self.errors.append(error)


@pytest.fixture(autouse=True)
def _fresh_cache():
    langchain_spec.clear_decoder_cache()
    yield
    langchain_spec.clear_decoder_cache()


MODELS = [SpeculativeLLM, ChatSpeculative]

# ---------------------------------------------------------------------------------------------------------------
# Construction and parameters
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize(
    "bad",
    [
        {"api_key": "x"},  # no API here
        {"max_retries": 2},  # a local decode has nothing to retry
        {"model": "gpt-4o"},  # the field is `target`
        {"max_new_tokens": 5},  # the LangChain name is max_tokens
        {"temprature": 0.5},
        {"top_p": 0.0},
        {"top_k": -1},
        {"temperature": -1},
        {"max_tokens": 0},
        {"seed": "abc"},
        {"stop": [""]},
        {"timeout": 0},
        {"batch_size": 0},
        {"num_draft_tokens": 0},
    ],
)
def test_unknown_or_invalid_parameters_are_errors(cls, bad):
    with pytest.raises(ValidationError):
        cls(**bad)


@pytest.mark.parametrize("cls", MODELS)
def test_decoder_excludes_model_arguments(cls, fake_decoder):
    with pytest.raises(ValidationError, match="either decoder= or"):
        cls(decoder=fake_decoder, target="HuggingFaceTB/SmolLM2-360M-Instruct")
    with pytest.raises(ValidationError, match="either decoder= or"):
        cls(decoder=fake_decoder, draft="none")
    with pytest.raises(ValidationError, match="spec_batch Decoder"):
        cls(decoder=object())
    model = cls(decoder=fake_decoder)
    assert model._identifying_params["target"] == "fake-target"
    assert model._identifying_params["draft"] == "ngram"


@pytest.mark.parametrize("cls", MODELS)
def test_standard_parameters_reach_the_decoder(cls, fake_decoder_cls):
    """LangChain's standard fields do what they say: sampling fields become the core's SamplingParams, streaming
    sends invoke's tokens to the callbacks, timeout stops a decode that runs longer."""
    fake_decoder = fake_decoder_cls(step_delay=0.01)
    fields = dict(temperature=0.5, max_tokens=100, top_p=0.9, top_k=7, seed=11, stop=["bold"], timeout=60)
    expected = SamplingParams(max_new_tokens=100, temperature=0.5, top_p=0.9, top_k=7, seed=11, stop=["bold"])
    text = lambda m: m if isinstance(m, str) else m.content

    handler = Tokens()
    out = cls(decoder=fake_decoder, streaming=True, **fields).invoke("x", config={"callbacks": [handler]})
    assert text(out) == "Hello there, general. You are a "
    assert fake_decoder.stream_calls[-1][1] == expected
    assert "".join(handler.tokens) == text(out) and len(handler.tokens) > 1
    handler = Tokens()
    cls(decoder=fake_decoder, streaming=False, **fields).invoke("x", config={"callbacks": [handler]})
    assert handler.tokens == []  # not streaming: callbacks get the result only
    cls(decoder=fake_decoder, **fields).batch(["a", "b"])
    assert fake_decoder.generate_calls[-1][1] == expected

    with pytest.raises(GenerationTimeout, match="timeout=0.05"):
        cls(decoder=fake_decoder, **{**fields, "timeout": 0.05}).invoke("x")


@pytest.mark.parametrize("cls", MODELS)
def test_langchain_copies_and_configurable_fields(cls, fake_decoder):
    from langchain_core.runnables import ConfigurableField

    model = cls(decoder=fake_decoder, max_tokens=5).configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
    out = model.with_config(configurable={"max_tokens": 2}).invoke("x")
    assert (out if isinstance(out, str) else out.content) == "He"
    assert cls(max_tokens=3).model_copy(update={"max_tokens": 4}).max_tokens == 4
    out = cls(decoder=fake_decoder, max_tokens=3).with_retry().with_fallbacks([cls(decoder=fake_decoder)]).invoke("x")
    assert (out if isinstance(out, str) else out.content) == "Hel"


@pytest.mark.parametrize("cls", MODELS)
def test_unknown_call_parameters_are_errors(cls, fake_decoder):
    model = cls(decoder=fake_decoder)
    with pytest.raises(InvalidParameterError, match="frequency_penalty"):
        model.invoke("hi", frequency_penalty=1.0)
    with pytest.raises(InvalidParameterError, match="target is fixed"):
        model.invoke("hi", model="other")
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        model.invoke("hi", max_new_tokens=3)
    with pytest.raises(InvalidParameterError, match="top_p"):
        model.invoke("hi", top_p=2.0)
    with pytest.raises(InvalidParameterError, match="timeout"):
        model.invoke("hi", timeout=-1)
    assert fake_decoder.generate_calls == [] and fake_decoder.stream_calls == []


@pytest.mark.parametrize("cls", MODELS)
def test_construction_does_not_load_and_config_shares_one_decoder(cls, fake_decoder_cls, monkeypatch):
    loads: list[tuple[tuple, dict]] = []

    def fake_load(*args: Any, **kwargs: Any) -> Any:
        loads.append((args, kwargs))
        time.sleep(0.05)  # wide window for a race
        return fake_decoder_cls()

    monkeypatch.setattr(factory, "load_decoder", fake_load)
    a, b = cls(max_tokens=5), cls(max_tokens=7, temperature=0.5)  # sampling differs, models do not
    c = cls(draft="none")
    assert loads == []
    results: list[Any] = []
    threads = [threading.Thread(target=lambda m=m: results.append(m._get_decoder())) for m in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and len({id(d) for d in results}) == 1
    assert loads[0] == (
        ("default", "suffix", torch.device("cpu"), torch.float32),
        {
            "num_draft_tokens": 16,  # the suffix default
            "adaptive": True,
            "ngram_min": 1,
            "ngram_max": 3,
            "drafter_options": None,
            "cache_dir": None,
            "trust_remote_code": False,
            "weights": "full",
            "draft_weights": "full",
            "tree_width": 1,  # resolved by the DecoderSpec: a chain drafter's width
        },  # the weight storage is part of the configuration
    )
    assert c._get_decoder() is not a._get_decoder()
    assert len(loads) == 2 and loads[1][0][1] == "none"
    # The LLM and the chat model of one configuration share it, and so does every other user of the process cache.
    other = (SpeculativeLLM if cls is ChatSpeculative else ChatSpeculative)()
    assert other._get_decoder() is a._get_decoder() is loading.shared_decoder()
    cls(num_draft_tokens=4)._get_decoder()
    assert loads[-1][1]["num_draft_tokens"] == 4
    # clear_decoder_cache (public) empties that one cache: the next call loads again.
    n = len(loads)
    langchain_spec.clear_decoder_cache()
    assert a._get_decoder() is not results[0] and len(loads) == n + 1


def test_failed_load_is_not_cached(monkeypatch):
    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise RuntimeError("no such model")

    monkeypatch.setattr(factory, "load_decoder", failing)
    llm = SpeculativeLLM(target="nope")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no such model"):
            llm.invoke("hi")
    assert len(calls) == 2


@pytest.mark.parametrize("cls,kind", [(SpeculativeLLM, "llm"), (ChatSpeculative, "chat")])
def test_ls_params_and_identifying_params(cls, kind, fake_decoder):
    model = cls(max_tokens=10, temperature=0.3, stop=["x"])
    ls = model._get_ls_params()
    assert ls["ls_provider"] == "spec_batch"
    assert ls["ls_model_name"] == "default"
    assert ls["ls_model_type"] == kind
    assert ls["ls_max_tokens"] == 10 and ls["ls_temperature"] == 0.3 and ls["ls_stop"] == ["x"]
    assert model._get_ls_params(stop=["y"], model="m")["ls_stop"] == ["y"]
    assert model._get_ls_params(model="m")["ls_model_name"] == "m"
    ident = model._identifying_params
    assert {k: ident[k] for k in ("target", "draft", "device", "max_tokens", "temperature", "stop")} == {
        "target": "default",
        "draft": "suffix",
        "device": "cpu",
        "max_tokens": 10,
        "temperature": 0.3,
        "stop": ["x"],
    }
    assert cls(decoder=fake_decoder)._get_ls_params()["ls_model_name"] == "fake-target"


# ---------------------------------------------------------------------------------------------------------------
# SpeculativeLLM
# ---------------------------------------------------------------------------------------------------------------


def test_llm_invoke_and_metadata(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder, max_tokens=12, temperature=0.7, top_p=0.9, top_k=5, seed=3)
    assert llm.invoke("Say hi") == fake_decoder.REPLY[:12]
    (prompt, params) = fake_decoder.stream_calls[-1]
    assert prompt == "Say hi"  # a text prompt is used as given
    assert params == SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=[])
    result = llm.generate(["Say hi"])
    info = result.generations[0][0].generation_info
    assert info["model_name"] == "fake-target" and info["draft_name"] == "ngram"
    assert info["finish_reason"] == "length"
    assert info["usage_metadata"] == {"input_tokens": 6, "output_tokens": 12, "total_tokens": 18}
    stats = info["speculative_stats"]
    assert stats["draft_tokens"] == 16 and stats["accepted_tokens"] == 8
    assert stats["acceptance_rate"] == 0.5 and stats["tokens_per_step"] == 3.0
    assert result.llm_output == {
        "model_name": "fake-target",
        "token_usage": {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18},
    }


def test_llm_per_call_overrides(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder, max_tokens=12)
    assert llm.invoke("x", max_tokens=4) == fake_decoder.REPLY[:4]
    assert fake_decoder.stream_calls[-1][1].max_new_tokens == 4
    llm.invoke("x", temperature=0.5, seed=9, top_k=2, top_p=0.5)
    p = fake_decoder.stream_calls[-1][1]
    assert (p.temperature, p.seed, p.top_k, p.top_p, p.max_new_tokens) == (0.5, 9, 2, 0.5, 12)
    assert llm.bind(max_tokens=5).invoke("x") == fake_decoder.REPLY[:5]


def test_llm_stop_sequences(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder, stop=["general"])
    assert llm.invoke("x") == "Hello there, "
    assert fake_decoder.stream_calls[-1][1].stop == ["general"]
    # A per-call stop replaces the instance's.
    assert llm.invoke("x", stop=["bold", "You"]) == "Hello there, general. "
    assert fake_decoder.stream_calls[-1][1].stop == ["bold", "You"]
    info = llm.generate(["x"]).generations[0][0].generation_info
    assert info["finish_reason"] == "stop"


def test_llm_batch_is_one_core_call(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder, max_tokens=8, batch_size=3)
    handler = Tokens()
    out = llm.batch(["a", "bb", "ccc", "dddd"], config={"callbacks": [handler]})
    assert out == [fake_decoder.REPLY[:8]] * 4
    assert len(fake_decoder.generate_calls) == 1 and fake_decoder.stream_calls == []
    prompts, params = fake_decoder.generate_calls[0]
    assert prompts == ["a", "bb", "ccc", "dddd"]
    assert params.max_new_tokens == 8
    assert handler.starts == 4 and handler.ends == 4
    result = llm.generate(["a", "bb"])
    assert result.llm_output["token_usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19}


def test_llm_stream_and_callbacks(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder, max_tokens=10)
    handler = Tokens()
    chunks = list(llm.stream("x", config={"callbacks": [handler]}))
    assert chunks == ["Hel", "lo ", "the", "r"]
    assert handler.tokens == chunks
    # streaming=True: invoke streams through the callbacks too, with the same text.
    streaming = SpeculativeLLM(decoder=fake_decoder, max_tokens=10, streaming=True)
    handler = Tokens()
    assert streaming.invoke("x", config={"callbacks": [handler]}) == "Hello ther"
    assert handler.tokens == ["Hel", "lo ", "the", "r"]
    info = streaming.generate(["x"]).generations[0][0].generation_info
    assert info["finish_reason"] == "length" and info["usage_metadata"]["output_tokens"] == 10
    # invoke(stream=True) is LangChain's per-call switch.
    handler = Tokens()
    llm.invoke("x", stream=True, config={"callbacks": [handler]})
    assert len(handler.tokens) == 4


def test_llm_chain(fake_decoder):
    chain = (
        PromptTemplate.from_template("Q: {q}\nA:")
        | SpeculativeLLM(decoder=fake_decoder, max_tokens=5)
        | StrOutputParser()
    )
    assert chain.invoke({"q": "why?"}) == "Hello"
    assert fake_decoder.stream_calls[-1][0] == "Q: why?\nA:"
    assert chain.batch([{"q": "1"}, {"q": "2"}]) == ["Hello", "Hello"]
    assert len(fake_decoder.generate_calls) == 1


async def test_llm_async(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder, max_tokens=6)
    assert await llm.ainvoke("x") == "Hello "
    assert await llm.abatch(["x", "y", "z"]) == ["Hello "] * 3
    assert len(fake_decoder.generate_calls) == 1
    handler = Tokens()
    chunks = [c async for c in llm.astream("x", config={"callbacks": [handler]})]
    assert "".join(chunks) == "Hello " and handler.tokens == chunks


def test_llm_batch_error_and_return_exceptions(fake_decoder):
    llm = SpeculativeLLM(decoder=fake_decoder)
    with pytest.raises(PromptTooLongError):
        llm.batch(["ok", fake_decoder.TOO_LONG])
    out = llm.batch(["ok", fake_decoder.TOO_LONG], return_exceptions=True)
    assert all(isinstance(o, PromptTooLongError) for o in out)


# ---------------------------------------------------------------------------------------------------------------
# Timeouts, cancellation and threads
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODELS)
def test_timeout_raises_and_stops_the_decode(cls, fake_decoder_cls):
    fake_decoder = fake_decoder_cls(step_delay=0.05)
    model = cls(decoder=fake_decoder, timeout=0.12)
    t0 = time.monotonic()
    with pytest.raises(GenerationTimeout, match="timeout=0.12"):
        model.invoke("x")
    assert time.monotonic() - t0 < 0.5 * fake_decoder.FULL_STEPS * 0.05  # well before the decode would end
    time.sleep(fake_decoder.FULL_STEPS * 0.05)  # by now an unstopped decode would have run all its steps
    assert fake_decoder.steps_run < fake_decoder.FULL_STEPS  # stopped after the step in progress
    assert wait_until(lambda: fake_decoder.active == 0)  # the decoder is free again
    assert isinstance(GenerationTimeout("x"), TimeoutError)
    # A per-call timeout overrides; long enough, the call succeeds.
    out = model.invoke("x", timeout=5, max_tokens=3)
    assert (out if isinstance(out, str) else out.content) == "Hel"


@pytest.mark.parametrize("cls", MODELS)
def test_timeout_while_streaming(cls, fake_decoder_cls):
    fake_decoder = fake_decoder_cls(step_delay=0.05)
    model = cls(decoder=fake_decoder, timeout=0.12)
    got: list[Any] = []
    with pytest.raises(TimeoutError):
        for chunk in model.stream("x"):
            got.append(chunk)
    assert 0 < len(got) < fake_decoder.FULL_STEPS
    assert wait_until(lambda: fake_decoder.active == 0)  # the decode stopped and let go of the decoder


@pytest.mark.parametrize("cls", MODELS)
def test_timeout_of_a_batch(cls, fake_decoder_cls):
    fake_decoder = fake_decoder_cls(step_delay=0.02)
    model = cls(decoder=fake_decoder, timeout=0.1)
    with pytest.raises(TimeoutError):
        model.batch(["a", "b", "c"])
    assert wait_until(lambda: fake_decoder.active == 0)
    # The core was asked to stop (should_stop) and stopped within the first request, not after the batch.
    assert fake_decoder.steps_run < fake_decoder.FULL_STEPS
    out = model.batch(["a", "b", "c"], return_exceptions=True)
    assert all(isinstance(o, TimeoutError) for o in out)
    assert len(fake_decoder.generate_calls) == 2  # the batch was not re-run per input
    assert wait_until(lambda: fake_decoder.active == 0)


def test_closing_a_stream_stops_the_decode(fake_decoder_cls):
    fake_decoder = fake_decoder_cls(step_delay=0.02)
    stream = SpeculativeLLM(decoder=fake_decoder).stream("x")
    next(stream)
    stream.close()
    time.sleep(fake_decoder.FULL_STEPS * 0.02)
    assert fake_decoder.steps_run < fake_decoder.FULL_STEPS and fake_decoder.active == 0


async def test_cancelling_an_async_call_stops_the_decode(fake_decoder_cls):
    fake_decoder = fake_decoder_cls(step_delay=0.02)
    chat = ChatSpeculative(decoder=fake_decoder)
    task = asyncio.create_task(chat.ainvoke("x"))
    await asyncio.sleep(0.07)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(fake_decoder.FULL_STEPS * 0.02)
    assert fake_decoder.steps_run < fake_decoder.FULL_STEPS and fake_decoder.active == 0
    with pytest.raises(TimeoutError):
        await ChatSpeculative(decoder=fake_decoder, timeout=0.05).ainvoke("x")


@pytest.mark.parametrize("cls", MODELS)
def test_many_threads_one_instance(cls, fake_decoder_cls):
    fake_decoder = fake_decoder_cls(step_delay=0.001)
    model = cls(decoder=fake_decoder, max_tokens=9)
    out: list[Any] = [None] * 8
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            if i % 2:
                out[i] = model.invoke(f"prompt {i}")
            else:
                out[i] = model.batch([f"p{i}", f"q{i}"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    text = lambda m: m if isinstance(m, str) else m.content
    for i, o in enumerate(out):
        if i % 2:
            assert text(o) == fake_decoder.REPLY[:9]
        else:
            assert [text(m) for m in o] == [fake_decoder.REPLY[:9]] * 2
    assert fake_decoder.max_active == 1  # the decoder ran one decode at a time


# ---------------------------------------------------------------------------------------------------------------
# ChatSpeculative
# ---------------------------------------------------------------------------------------------------------------


def test_messages_to_chat_template(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=5)
    msg = chat.invoke(
        [
            SystemMessage("be brief"),
            HumanMessage("hi", name="ann"),
            AIMessage("hello"),
            HumanMessage([{"type": "text", "text": "two ", "index": 0}, "parts"]),  # LangChain's keys are dropped
            ToolMessage("42", tool_call_id="1"),
            ChatMessage(role="developer", content="meh"),
        ]
    )
    assert fake_decoder.templates[-1] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "two parts"},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
        {"role": "system", "content": "meh"},  # developer is the system role
    ]
    assert isinstance(msg, AIMessage) and msg.content == "Hello"
    # The prompt reaches the core as the template's token ids, not as text.
    prompt = fake_decoder.stream_calls[-1][0]
    assert isinstance(prompt, list) and prompt == fake_decoder.apply_chat_template(fake_decoder.templates[-1])
    # A plain string is one user turn.
    chat.invoke("hey")
    assert fake_decoder.templates[-1] == [{"role": "user", "content": "hey"}]


@pytest.mark.parametrize(
    "messages,match",
    [
        (
            [HumanMessage([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])],
            r"messages\[0\]\.content\[0\]: content parts of type 'image_url' are not supported",
        ),
        (
            [HumanMessage("a"), HumanMessage(["b", {"type": "image", "base64": "AAAA", "mime_type": "image/png"}])],
            r"messages\[1\]\.content\[1\]: content parts of type 'image' are not supported",
        ),
        ([SystemMessage("s"), ChatMessage(role="critic", content="meh")], r"messages\[1\]\.role: .*got 'critic'"),
        ([FunctionMessage(name="f", content="1")], r"messages\[0\]: is a FunctionMessage"),
    ],
)
def test_unsupported_messages_are_errors(fake_decoder, messages, match):
    with pytest.raises(UnsupportedMessageError, match=match):
        ChatSpeculative(decoder=fake_decoder).invoke(messages)
    assert issubclass(UnsupportedMessageError, ValueError) and issubclass(UnsupportedMessageError, ChatTemplateError)
    assert fake_decoder.templates == [] and fake_decoder.stream_calls == []  # refused before the core


def test_chat_metadata(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=50)
    msg = chat.invoke("hi")
    prompt_len = len(fake_decoder.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert msg.content == fake_decoder.REPLY
    assert msg.usage_metadata == {
        "input_tokens": prompt_len,
        "output_tokens": len(fake_decoder.REPLY),
        "total_tokens": prompt_len + len(fake_decoder.REPLY),
    }
    md = msg.response_metadata
    assert md["model_name"] == "fake-target" and md["finish_reason"] == "stop" and md["draft_name"] == "ngram"
    stats = md["speculative_stats"]
    assert set(stats) >= {"draft_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_step", "target_forwards"}
    assert chat.get_num_tokens_from_messages([HumanMessage("hi")]) == prompt_len
    assert chat.get_num_tokens("123456789 987654321") == 2  # the target's tokenizer (ids as numbers), not GPT-2's


def test_chat_stream(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=7)
    handler = Tokens()
    chunks = list(chat.stream("hi", config={"callbacks": [handler]}))
    assert [c.content for c in chunks] == ["Hel", "lo ", "t"]
    assert [c.chunk_position for c in chunks] == [None, None, "last"]
    assert handler.tokens == ["Hel", "lo ", "t"]  # every chunk once (LangChain reports them)
    assert all(c.usage_metadata is None for c in chunks[:-1])
    full = chunks[0] + chunks[1] + chunks[2]
    assert full.content == "Hello t"
    assert full.usage_metadata["output_tokens"] == 7
    assert full.response_metadata["model_name"] == "fake-target"
    assert full.response_metadata["finish_reason"] == "length"
    # streaming=True: invoke goes through the stream and the callbacks see each chunk.
    handler = Tokens()
    msg = ChatSpeculative(decoder=fake_decoder, max_tokens=7, streaming=True).invoke(
        "hi", config={"callbacks": [handler]}
    )
    assert msg.content == "Hello t" and handler.tokens[:3] == ["Hel", "lo ", "t"]
    assert msg.response_metadata["speculative_stats"]["output_tokens"] == 7


def test_chat_stop(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, stop=["there"])
    assert chat.invoke("hi").content == "Hello "
    assert chat.invoke("hi", stop=["."]).content == "Hello there, general"
    assert "".join(c.content for c in chat.stream("hi", stop=["."])) == "Hello there, general"


def test_chat_batch_is_one_core_call_with_per_input_callbacks(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=5)
    handler = Tokens()
    inputs = ["one", [HumanMessage("two")], [SystemMessage("s"), HumanMessage("three")]]
    out = chat.batch(inputs, config={"callbacks": [handler]})
    assert [m.content for m in out] == ["Hello"] * 3
    assert len(fake_decoder.generate_calls) == 1 and fake_decoder.stream_calls == []
    prompts, params = fake_decoder.generate_calls[0]
    assert len(prompts) == 3 and all(isinstance(p, list) for p in prompts)
    assert params.max_new_tokens == 5
    assert handler.starts == 3 and handler.ends == 3
    assert all(m.usage_metadata and m.response_metadata["model_name"] == "fake-target" for m in out)
    assert len({m.id for m in out}) == 3  # LangChain's per-run ids
    # Per-call kwargs and stop reach the batched call.
    out = chat.batch(["a", "b"], stop=["l"], max_tokens=9)
    assert [m.content for m in out] == ["He", "He"]
    assert fake_decoder.generate_calls[-1][1].stop == ["l"] and fake_decoder.generate_calls[-1][1].max_new_tokens == 9
    # generate() with many message lists is one call too.
    result = chat.generate([[HumanMessage("a")], [HumanMessage("b")]])
    assert len(fake_decoder.generate_calls) == 3 and len(result.generations) == 2
    # Duplicate prompts each get their own result.
    assert [m.content for m in chat.batch(["same", "same", "same"])] == ["Hello"] * 3
    assert len(fake_decoder.generate_calls) == 4 and fake_decoder.stream_calls == []


def test_chat_batch_errors_stay_per_input(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=5)
    image = [HumanMessage([{"type": "image", "url": "u"}])]
    out = chat.batch(["fine", fake_decoder.TOO_LONG, image, "also fine"], return_exceptions=True)
    assert out[0].content == "Hello" and out[3].content == "Hello"
    assert isinstance(out[1], PromptTooLongError)
    assert isinstance(out[2], UnsupportedMessageError)
    assert len(fake_decoder.generate_calls) == 1  # the good prompts were still decoded together
    with pytest.raises(PromptTooLongError):
        chat.batch(["fine", fake_decoder.TOO_LONG])
    out = chat.batch(["a", "b"], top_p=5.0, return_exceptions=True)
    assert all(isinstance(o, InvalidParameterError) for o in out)


def test_chat_batch_with_streaming_true_is_still_one_call(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=5, streaming=True)
    handler = Tokens()
    out = chat.batch(["a", "b", "c"], config={"callbacks": [handler]})
    assert [m.content for m in out] == ["Hello"] * 3
    assert len(fake_decoder.generate_calls) == 1 and fake_decoder.stream_calls == []
    assert handler.tokens == ["Hello"] * 3  # each result reaches the callbacks as one chunk


def test_chat_batch_with_cache_uses_the_cache(fake_decoder):
    from langchain_core.caches import InMemoryCache

    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=5, cache=InMemoryCache())
    assert [m.content for m in chat.batch(["a", "b"])] == ["Hello", "Hello"]
    assert [m.content for m in chat.batch(["a", "b"])] == ["Hello", "Hello"]
    assert (
        len(fake_decoder.stream_calls) == 2 and fake_decoder.generate_calls == []
    )  # second batch answered by the cache


def test_chat_chain(fake_decoder):
    prompt = ChatPromptTemplate.from_messages([("system", "You are terse."), ("human", "{q}")])
    chain = prompt | ChatSpeculative(decoder=fake_decoder, max_tokens=5) | StrOutputParser()
    assert chain.invoke({"q": "hi"}) == "Hello"
    assert fake_decoder.templates[-1] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
    ]
    assert chain.batch([{"q": "a"}, {"q": "b"}]) == ["Hello", "Hello"]
    assert len(fake_decoder.generate_calls) == 1
    assert "".join(chain.stream({"q": "hi"})) == "Hello"


async def test_chat_async(fake_decoder):
    chat = ChatSpeculative(decoder=fake_decoder, max_tokens=5)
    msg = await chat.ainvoke("hi")
    assert msg.content == "Hello" and msg.usage_metadata["output_tokens"] == 5
    out = await chat.abatch(["a", "b", "c"])
    assert [m.content for m in out] == ["Hello"] * 3 and len(fake_decoder.generate_calls) == 1
    out = await chat.agenerate([[HumanMessage("a")], [HumanMessage("b")]])
    assert len(fake_decoder.generate_calls) == 2 and len(out.generations) == 2

    class AsyncTokens(AsyncCallbackHandler):
        tokens: list[str] = []

        async def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    handler = AsyncTokens()
    chunks = [c async for c in chat.astream("hi", config={"callbacks": [handler]})]
    assert "".join(c.content for c in chunks) == "Hello" and chunks[-1].chunk_position == "last"
    assert handler.tokens[:2] == ["Hel", "lo"]
    events = [e async for e in chat.astream_events("hi", version="v2")]
    assert [e["data"]["chunk"].content for e in events if e["event"] == "on_chat_model_stream"][:2] == ["Hel", "lo"]
