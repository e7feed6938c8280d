"""Shared fixtures: tiny random Llama models, a tiny fake tokenizer, the real default decoder.

Keep this file to fixtures that are generally useful; test-specific helpers live in the test modules.

- ``fake_tokenizer``: token ids <-> "3 14 15" text; ``fake_tokenizer_cls(eos_token_id=...)`` for EOS tests.
- ``byte_tokenizer``: a 64-token byte vocabulary (id 0 = EOS) that spells JSON, for grammars on tiny models.
- ``tiny_llama(seed, vocab=64, layers=2, lm_head_scale=1.0)``: a tiny random LlamaForCausalLM (cached per session;
  never mutate it). EOS/BOS/PAD are None in its config, so plain decoding never stops early.
- ``tiny_target`` / ``tiny_draft``: a target (vocab 64, 2 layers) and a *different* draft (1 layer), session-scoped.
- ``tiny_decoder(draft, **kw)``: a Decoder over ``tiny_target`` (draft: "ngram" | "none" | a model).
- ``hf_greedy(model, ids, n, eos_token_id=None)``: Hugging Face ``generate`` greedy continuation (the oracle).
- ``default_decoder``: ``load_decoder("default", "ngram")``, session-scoped (tests using it are ``slow``).
- ``fake_decoder`` / ``fake_decoder_cls``: the Decoder interface without a model (tests of what wraps the core).
- Database fixtures (``db_url``, ``empty_db_url``, ``pg_admin``, ``pg_url``): tests/db_fixtures.py.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_batch import (
    ChatTemplateError,
    GenerationResult,
    PromptTooLongError,
    RequestStats,
    SamplingParams,
    StreamChunk,
)
from spec_batch.loading import build_decoder

# Database fixtures (SQLite and PostgreSQL) for the jobs, store, CLI and worker tests.
pytest_plugins = ["db_fixtures"]

CPU = torch.device("cpu")

# One intra-op thread unless OMP_NUM_THREADS says otherwise: the models here are tiny (or small), and on a busy
# machine (tests run next to other processes) torch's spinning worker threads make each forward many times slower.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# The tests compare the CLI, servers and workers (which read SPEC_BATCH_WEIGHTS, default auto: w4a8 on the CPU) with
# the Python API (weights=None: full) on the same outputs: both at full unless a test says otherwise
# (tests/cli/test_cli_default_weights.py runs the default).
os.environ.setdefault("SPEC_BATCH_WEIGHTS", "full")

# What the CLI prints must not depend on the runner's terminal: pytest-xdist's workers inherit COLUMNS=80 (a plain
# run has none), and the CLI honours COLUMNS, so rows (job ids, paths, commands) wrapped in one and not the other.
for _var in ("COLUMNS", "LINES"):
    os.environ.pop(_var, None)


class FakeTokenizer:
    """Token ids as space-separated integers. Enough for a Decoder over a tiny model."""

    def __init__(self, eos_token_id: int | None = None, pad_token_id: int | None = None):
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens and self.eos_token_id is not None:
            ids = [i for i in ids if i != self.eos_token_id]
        return " ".join(map(str, ids))

    def __call__(self, text: str, **kwargs) -> dict:
        return {"input_ids": self.encode(text)}


# 64 tokens, so the tiny models can write JSON, choices and regex matches; several spell the same text
# ("yes" = yes | ye+s | y+e+s), so grammars see overlapping tokenizations. Id 0 is EOS.
BYTE_VOCAB: list[bytes] = (
    [b"<eos>", b"{", b"}", b"[", b"]", b'"', b":", b",", b" "]
    + [bytes([c]) for c in b"0123456789abcdefghijklmnopqrstuvwxyz"]
    + [
        b'{"',
        b'": ',
        b'", "',
        b'"}',
        b', "',
        b"true",
        b"false",
        b"null",
        b"yes",
        b"no",
        b"ye",
        b"name",
        b"age",
        b"-",
        b".",
        b"ab",
        b"abc",
        b"\n",
        b'"]',
    ]
)
assert len(BYTE_VOCAB) == 64


class ByteTokenizer:
    """Tokens are byte strings (``token_bytes``); encode is greedy longest match, decode concatenates."""

    eos_token_id = 0
    pad_token_id = None
    token_bytes = BYTE_VOCAB

    def encode(self, text: str, **kwargs) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            n, tid = max((len(t), j) for j, t in enumerate(BYTE_VOCAB[1:], 1) if data.startswith(t, i))
            out.append(tid)
            i += n
        return out

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        keep = [int(i) for i in ids if not (skip_special_tokens and int(i) == self.eos_token_id)]
        return b"".join(BYTE_VOCAB[i] for i in keep).decode(errors="replace")

    def __call__(self, text: str, **kwargs) -> dict:
        return {"input_ids": self.encode(text)}


def _make_tiny_llama(seed: int, vocab: int, layers: int, lm_head_scale: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=vocab,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    if lm_head_scale != 1.0:  # sharper next-token distributions (random init is close to uniform)
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


_TINY_CACHE: dict[tuple, LlamaForCausalLM] = {}


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory of tiny random Llama models, cached per session by their arguments (do not mutate them)."""

    def make(seed: int, vocab: int = 64, layers: int = 2, lm_head_scale: float = 1.0) -> LlamaForCausalLM:
        key = (seed, vocab, layers, lm_head_scale)
        if key not in _TINY_CACHE:
            _TINY_CACHE[key] = _make_tiny_llama(seed, vocab, layers, lm_head_scale)
        return _TINY_CACHE[key]

    return make


@pytest.fixture(scope="session")
def fake_tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture(scope="session")
def fake_tokenizer_cls() -> type[FakeTokenizer]:
    """The class, for tokenizers with an EOS id: ``fake_tokenizer_cls(eos_token_id=5)``."""
    return FakeTokenizer


@pytest.fixture(scope="session")
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_llama) -> LlamaForCausalLM:
    return tiny_llama(1, vocab=64, layers=2)


@pytest.fixture(scope="session")
def tiny_draft(tiny_llama) -> LlamaForCausalLM:
    return tiny_llama(2, vocab=64, layers=1)


@pytest.fixture(scope="session")
def tiny_decoder(tiny_target, fake_tokenizer):
    """Factory: a Decoder over tiny_target. draft: "ngram" | "none" | a draft model; kw go to build_decoder."""

    def make(draft="ngram", *, target=None, tokenizer=None, num_draft_tokens: int = 4, **kw):
        return build_decoder(
            target if target is not None else tiny_target,
            tokenizer if tokenizer is not None else fake_tokenizer,
            target_name="tiny",
            draft=draft,
            device=CPU,
            num_draft_tokens=num_draft_tokens,
            **kw,
        )

    return make


@pytest.fixture(scope="session")
def hf_greedy():
    """The oracle: Hugging Face generate's greedy continuation of ids (EOS stripped if it ends the output)."""

    def run(model, ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        x = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(x))
        if eos_token_id is None and model.generation_config.eos_token_id is None:
            kwargs.update(min_new_tokens=max_new_tokens, pad_token_id=0)  # never stops early
        elif eos_token_id is not None:
            kwargs.update(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
        with torch.inference_mode():
            out = model.generate(x, **kwargs)[0, len(ids) :].tolist()
        eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
        eos_set = {eos} if isinstance(eos, int) else set(eos or [])
        for i, tok in enumerate(out):
            if tok in eos_set:
                return out[:i]
        return out

    return run


@pytest.fixture(scope="session")
def default_decoder():
    """The real default model with the n-gram drafter (converted once and cached on disk; ~5-20 s)."""
    from spec_batch import load_decoder

    return load_decoder("default", "ngram")


# ---------------------------------------------------------------------------------------------------------------
# A fake decoder: the Decoder interface without a model, for tests of what wraps the core.
# ---------------------------------------------------------------------------------------------------------------


class FakeDecoder:
    """Answers every prompt with REPLY, STEP characters per step (characters are its tokens; the end of REPLY is
    EOS), cut by max_new_tokens and stop strings; a prompt containing TOO_LONG does not fit the context.

    Like the real decoder it runs one decode at a time (`max_active` records the most at once) and honours
    `should_stop` after every step (rows not finished end "cancelled"). It records its calls (generate_calls,
    stream_calls, templates) and steps (steps_run); `step_delay` seconds per step make time-outs testable.
    For the job tests: messages containing BAD_TEMPLATE make the chat template fail; `interrupt_after=n` raises
    KeyboardInterrupt (a Ctrl-C) after n results; `without_speculation()` is the same fake with the "none"
    drafter (the same text, one token per step, nothing drafted).
    """

    REPLY = "Hello there, general. You are a bold one."
    TOO_LONG = "TOO LONG"
    BAD_TEMPLATE = "BAD TEMPLATE"
    STEP = 3  # tokens accepted per step (2 accepted draft tokens + 1 bonus)
    FULL_STEPS = -(-len(REPLY) // STEP)  # steps of a decode that runs to its end

    target_name = "fake-target"
    draft_name = "ngram"
    device = "cpu"
    max_context = 4096
    vocab_size = 0x110000  # its token ids are characters

    def __init__(
        self, step_delay: float = 0.0, *, draft_name: str = "ngram", interrupt_after: int | None = None
    ) -> None:
        self.tokenizer = FakeTokenizer()  # for token counting only; the prompts' token ids are characters
        self.step_delay = step_delay
        self.draft_name = draft_name
        self.uses_memory = draft_name == "suffix"  # like the real suffix drafter, it takes a job memory
        self.interrupt_after = interrupt_after
        self.results_given = 0
        self.generate_calls: list[tuple[list[Any], Any]] = []
        self.memories: list[Any] = []  # the job memory each generate() call was given
        self.stream_calls: list[tuple[Any, SamplingParams]] = []
        self.templates: list[list[dict]] = []
        self.steps_run = 0
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    # --- the "model" ---
    @staticmethod
    def _prompt_text(prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else "".join(chr(i) for i in prompt)

    def _decode(self, prompt: str | list[int], params: SamplingParams) -> GenerationResult:
        text = self._prompt_text(prompt)
        if self.TOO_LONG in text:
            raise PromptTooLongError(f"prompt of {len(text)} tokens does not fit")
        out, reason = self.REPLY, "stop"
        if len(out) > params.max_new_tokens:
            out, reason = out[: params.max_new_tokens], "length"
        cuts = [out.find(s) for s in params.stop if s in out]
        if cuts:
            out, reason = out[: min(cuts)], "stop"
        if self.draft_name == "none":  # no speculation: one token per step
            steps = max(1, len(out))
            stats = RequestStats(prompt_tokens=len(text), output_tokens=len(out), target_forwards=steps)
            return GenerationResult(text=out, token_ids=[ord(c) for c in out], finish_reason=reason, stats=stats)
        steps = max(1, -(-len(out) // self.STEP))
        stats = RequestStats(
            prompt_tokens=len(text),
            output_tokens=len(out),
            draft_tokens=4 * steps,
            accepted_tokens=len(out) - steps,
            target_forwards=steps,
        )
        return GenerationResult(text=out, token_ids=[ord(c) for c in out], finish_reason=reason, stats=stats)

    def _enter(self) -> None:
        self._lock.acquire()
        self.active += 1
        self.max_active = max(self.max_active, self.active)

    def _exit(self) -> None:
        self.active -= 1
        self._lock.release()

    def _step(self) -> None:
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps_run += 1

    # --- the core's interface ---
    def generate(
        self, prompts, params=None, batch_size=8, *, return_errors=False, on_result=None, should_stop=None, memory=None
    ):
        prompts = list(prompts)
        self.generate_calls.append((prompts, params))
        self.memories.append(memory)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if not return_errors:
            for p in prompts:
                if self.TOO_LONG in self._prompt_text(p):
                    raise PromptTooLongError("a prompt does not fit")
        self._enter()
        try:
            results = []
            for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
                if self.interrupt_after is not None and self.results_given >= self.interrupt_after:
                    raise KeyboardInterrupt
                try:
                    result = self._decode(prompt, p)
                except PromptTooLongError as exc:
                    result = GenerationResult("", [], "error", RequestStats(), error=str(exc))
                for step in range(result.stats.target_forwards):
                    if should_stop is not None and should_stop():
                        text = result.text[: step * self.STEP]
                        result = GenerationResult(text, [ord(c) for c in text], "cancelled", RequestStats())
                        break
                    self._step()
                results.append(result)
                self.results_given += 1
                if on_result is not None:
                    on_result(i, result)
            return results
        finally:
            self._exit()

    def stream(self, prompt, params=None):
        params = params or SamplingParams()
        self.stream_calls.append((prompt, params))
        result = self._decode(prompt, params)
        self._enter()
        try:
            pieces = [result.text[i : i + self.STEP] for i in range(0, len(result.text), self.STEP)] or [""]
            for i, piece in enumerate(pieces):
                self._step()
                last = i == len(pieces) - 1
                yield StreamChunk(
                    text=piece,
                    token_ids=[ord(c) for c in piece],
                    finish_reason=result.finish_reason if last else None,
                    stats=result.stats if last else None,
                )
        finally:
            self._exit()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        self.templates.append(messages)
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        if self.BAD_TEMPLATE in text:
            raise ChatTemplateError(f"the fake chat template rejects {self.BAD_TEMPLATE!r}")
        return [ord(c) for c in text]

    def without_speculation(self) -> FakeDecoder:
        return type(self)(self.step_delay, draft_name="none")


@pytest.fixture
def fake_decoder() -> FakeDecoder:
    return FakeDecoder()


@pytest.fixture(scope="session")
def fake_decoder_cls() -> type[FakeDecoder]:
    """The class, for a slow one (``fake_decoder_cls(step_delay=0.05)``) and its constants (REPLY, STEP, ...)."""
    return FakeDecoder
