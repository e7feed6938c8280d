"""SpeculativeLLM and ChatSpeculative on the real core and the default model (SmolLM2-135M-Instruct, CPU).

The reference for exactness is the same target decoded without speculation (Decoder.without_speculation()):
greedy output through LangChain must equal it token for token (compared as text, and as token counts).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate

from langchain_spec import ChatSpeculative, GenerationTimeout, SpeculativeLLM
from langchain_spec.chat_models import messages_to_dicts
from spec_batch import SamplingParams

pytestmark = pytest.mark.slow

N = 12  # max_tokens: short, to keep the suite quick on a CPU
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time"]
CHAT = [SystemMessage("Answer briefly."), HumanMessage("Name a colour of the sky.")]


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeLLM()._get_decoder()


@pytest.fixture(scope="module")
def baseline(decoder):
    """Plain decoding of the same target: what the speculative output must equal."""
    return decoder.without_speculation()


@pytest.fixture(scope="module")
def llm_reference(baseline):
    return baseline.generate(TEXT_PROMPTS, SamplingParams(max_new_tokens=N))


@pytest.fixture(scope="module")
def chat_reference(baseline):
    ids = baseline.apply_chat_template(messages_to_dicts(CHAT))
    return baseline.generate([ids], SamplingParams(max_new_tokens=N))[0]


class CountingDecoder:
    """Wraps the real decoder and counts the core calls LangChain makes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.generate_calls: list[int] = []
        self.stream_calls = 0

    def generate(self, prompts, *args, **kwargs):
        self.generate_calls.append(len(prompts))
        return self._inner.generate(prompts, *args, **kwargs)

    def stream(self, *args, **kwargs):
        self.stream_calls += 1
        return self._inner.stream(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_one_decoder_shared(decoder):
    assert ChatSpeculative(max_tokens=3)._get_decoder() is decoder
    assert SpeculativeLLM(temperature=0.5)._get_decoder() is decoder


# ---------------------------------------------------------------------------------------------------------------
# SpeculativeLLM
# ---------------------------------------------------------------------------------------------------------------


def test_llm_invoke_is_exact_and_reports_stats(decoder, llm_reference):
    llm = SpeculativeLLM(max_tokens=N)
    result = llm.generate(TEXT_PROMPTS[:1])
    gen = result.generations[0][0]
    assert gen.text == llm_reference[0].text
    info = gen.generation_info
    assert info["model_name"] == decoder.target_name and info["draft_name"] == "suffix"  # the default drafter
    assert info["finish_reason"] == llm_reference[0].finish_reason
    stats = info["speculative_stats"]
    assert stats["output_tokens"] == len(llm_reference[0].token_ids) == info["usage_metadata"]["output_tokens"]
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["target_forwards"] >= 1 and stats["tokens_per_step"] >= 1.0
    if stats["draft_tokens"]:
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted_tokens"] / stats["draft_tokens"])
    usage = info["usage_metadata"]
    assert usage["input_tokens"] == len(decoder.tokenizer.encode(TEXT_PROMPTS[0])) == stats["prompt_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert result.llm_output["token_usage"]["completion_tokens"] == usage["output_tokens"]


def test_llm_batch_is_one_call_and_exact(decoder, llm_reference):
    counting = CountingDecoder(decoder)
    llm = SpeculativeLLM(decoder=counting, max_tokens=N)
    out = llm.batch(TEXT_PROMPTS)
    assert counting.generate_calls == [len(TEXT_PROMPTS)] and counting.stream_calls == 0
    assert out == [r.text for r in llm_reference]  # every row equals its own plain decode


def test_llm_stream_chunks_and_callbacks(llm_reference):
    llm = SpeculativeLLM(max_tokens=N)
    handler = Tokens()
    chunks = list(llm.stream(TEXT_PROMPTS[0], config={"callbacks": [handler]}))
    assert "".join(chunks) == llm_reference[0].text
    assert len(chunks) >= 2 and handler.tokens == chunks
    # streaming=True: invoke delivers the same tokens to the callbacks.
    handler = Tokens()
    text = SpeculativeLLM(max_tokens=N, streaming=True).invoke(TEXT_PROMPTS[0], config={"callbacks": [handler]})
    assert text == llm_reference[0].text and "".join(handler.tokens) == text


def test_llm_stop_cuts_at_the_first_stop(llm_reference):
    full = llm_reference[0].text  # " Paris. ..." style continuation
    stop = full.strip().split()[1][:3]  # a piece of the second word: occurs after the start
    expected = full[: full.index(stop)]
    llm = SpeculativeLLM(max_tokens=N)
    gen = llm.generate(TEXT_PROMPTS[:1], stop=[stop, "\u2603never"]).generations[0][0]
    assert gen.text == expected and gen.generation_info["finish_reason"] == "stop"
    assert "".join(llm.stream(TEXT_PROMPTS[0], stop=[stop])) == expected


def test_llm_chain(llm_reference):
    prompt = PromptTemplate.from_template("The capital of {country} is")
    chain = prompt | SpeculativeLLM(max_tokens=N) | StrOutputParser()
    assert chain.invoke({"country": "France"}) == llm_reference[0].text


async def test_llm_async(decoder, llm_reference):
    counting = CountingDecoder(decoder)
    llm = SpeculativeLLM(decoder=counting, max_tokens=N)
    assert await llm.ainvoke(TEXT_PROMPTS[1]) == llm_reference[1].text
    assert await llm.abatch(TEXT_PROMPTS[:2]) == [r.text for r in llm_reference[:2]]
    assert counting.generate_calls == [2]
    chunks = [c async for c in llm.astream(TEXT_PROMPTS[2])]
    assert "".join(chunks) == llm_reference[2].text


def test_seeded_sampling_is_reproducible_in_and_out_of_batches():
    llm = SpeculativeLLM(max_tokens=8, temperature=0.9, seed=1234)
    alone = llm.invoke(TEXT_PROMPTS[2])
    assert llm.batch([TEXT_PROMPTS[0], TEXT_PROMPTS[2]])[1] == alone
    other_seed = SpeculativeLLM(max_tokens=8, temperature=0.9, seed=99).invoke(TEXT_PROMPTS[2])
    assert llm.invoke(TEXT_PROMPTS[2], seed=99) == other_seed  # a per-call seed overrides the instance's


def test_timeout_stops_a_long_decode_and_frees_the_decoder(llm_reference):
    llm = SpeculativeLLM(max_tokens=400, timeout=0.5)
    with pytest.raises(GenerationTimeout):
        llm.invoke("1, 2, 3, 4, 5, 6,")  # counts on for all 400 tokens (~100+ steps) unless stopped
    # The decode was stopped: the next call gets the decoder and finishes normally.
    assert SpeculativeLLM(max_tokens=N, timeout=120).invoke(TEXT_PROMPTS[0]) == llm_reference[0].text


def test_threads_share_one_instance(llm_reference):
    llm = SpeculativeLLM(max_tokens=N)
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, llm.invoke(TEXT_PROMPTS[i]))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(3)] == [r.text for r in llm_reference]


# ---------------------------------------------------------------------------------------------------------------
# ChatSpeculative (the standard suite in test_langchain_standard_integration.py covers the rest)
# ---------------------------------------------------------------------------------------------------------------


def test_chat_is_exact_through_the_chat_template(decoder, chat_reference):
    msg = ChatSpeculative(max_tokens=N).invoke(CHAT)
    assert msg.content == chat_reference.text
    assert msg.usage_metadata["input_tokens"] == len(decoder.apply_chat_template(messages_to_dicts(CHAT)))
    assert msg.usage_metadata["output_tokens"] == len(chat_reference.token_ids)
    md = msg.response_metadata
    assert md["model_name"] == decoder.target_name and md["finish_reason"] == chat_reference.finish_reason
    assert {"draft_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_step"} <= set(md["speculative_stats"])


def test_chat_chain_stream_and_batch(decoder, chat_reference):
    counting = CountingDecoder(decoder)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer briefly."), ("human", "{q}")])
    chain = prompt | ChatSpeculative(decoder=counting, max_tokens=N) | StrOutputParser()
    assert "".join(chain.stream({"q": "Name a colour of the sky."})) == chat_reference.text
    out = chain.batch([{"q": "Name a colour of the sky."}, {"q": "Say hi."}])
    assert out[0] == chat_reference.text
    assert counting.generate_calls == [2]


async def test_chat_stop_and_async(chat_reference):
    full = chat_reference.text
    stop = full.split()[1][:3]
    chat = ChatSpeculative(max_tokens=N)
    msg = await chat.ainvoke(CHAT, stop=[stop])
    assert msg.content == full[: full.index(stop)] and msg.response_metadata["finish_reason"] == "stop"
    chunks = [c async for c in chat.astream(CHAT)]
    assert "".join(c.content for c in chunks) == full and chunks[-1].chunk_position == "last"
    results = await asyncio.gather(chat.ainvoke(CHAT), chat.ainvoke(CHAT))
    assert [m.content for m in results] == [full, full]
