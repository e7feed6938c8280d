"""Grammar-constrained decoding with llguidance: the tokenizer bridge, compiled grammars, per-row matchers, masks.

The constrained distribution at an output position is the target's restricted to the tokens the grammar allows
there, renormalized. Under speculation every verify position has its own mask: a row's matcher is advanced
through the draft (speculatively) to compute them, and rolled back to the accepted prefix after verification.

A matcher that fails while decoding (the engine gives up: a forced run or a parse past its limits, see
response_format.py) fails its own request only: its GrammarState records `failure`, allows everything from then on
(its logits stay finite; nothing it computes is kept) and the decoder ends that row with finish_reason "error".

Masks are llguidance bitmasks: int32 words, bit t % 32 of word t // 32 set when token t is allowed
([..., words] with words = ceil(tokenizer vocabulary / 32)). Model output rows past the tokenizer's vocabulary
(padding rows) are never allowed under a grammar.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher

from ...errors import InvalidParameterError
from .grammar_tokenizer import llg_tokenizer
from .response_format import (
    NO_STRING,
    TOO_COMPLEX,
    ResponseFormat,
    engine_reason,
    grammar_limits,
    parse_response_format,
    starts_dead,
)

__all__ = [
    "GrammarEngine",
    "GrammarState",
    "ResponseFormat",
    "apply_bitmask",
    "grammar_engine",
    "mask_logits",
    "mask_next",
    "parse_response_format",
    "unpack_bitmask",
]

ALL_ALLOWED = -1  # an int32 word with every bit set


# ---------------------------------------------------------------- compiled grammars, per tokenizer


class GrammarEngine:
    """One tokenizer's llguidance view and an LRU of compiled grammars (one matcher template per grammar;
    a request gets a cheap deep copy). `compiles` counts grammar compilations (cache misses)."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], cache_size: int = 64):
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        if not self.eos_ids:
            raise InvalidParameterError("response_format needs a model with an EOS token: a grammar ends with it")
        self.tokenizer = llg_tokenizer(tokenizer, sorted(self.eos_ids))
        self.vocab_size = self.tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.cache_size = cache_size
        self.compiles = 0
        self._templates: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, fmt: ResponseFormat) -> LLMatcher:
        """A fresh matcher for fmt at the start of an output; compiles fmt at most once while it is cached."""
        with self._lock:
            template = self._templates.get(fmt.key)
            if template is not None:
                self._templates.move_to_end(fmt.key)
                return template.deep_copy()
        # drops the GIL while it compiles
        template = LLMatcher(self.tokenizer, fmt.grammar(), log_level=0, limits=grammar_limits())
        if starts_dead(template):  # e.g. a ResponseFormat built without parse_response_format's check
            raise InvalidParameterError(f'response_format matches no string at all (not even ""): {NO_STRING}')
        if template.is_error():
            raise InvalidParameterError(
                f"response_format: the grammar engine cannot compile it: {engine_reason(template.get_error())}"
            )
        with self._lock:
            self.compiles += 1
            self._templates[fmt.key] = template
            while len(self._templates) > self.cache_size:
                self._templates.popitem(last=False)
        return template.deep_copy()

    def state(self, response_format: ResponseFormat | None) -> GrammarState | None:
        """A request's matcher state for its response_format (SamplingParams.response_format, parsed once
        there); None when unconstrained. A plain dict is parsed here for callers without SamplingParams."""
        fmt = response_format if isinstance(response_format, ResponseFormat) else parse_response_format(response_format)
        if fmt is None:
            return None
        return GrammarState(self.matcher(fmt), self.words, self.eos_ids, on_fail=lambda: self.forget(fmt.key))

    def forget(self, key: tuple[str, str]) -> None:
        """Drops a compiled grammar: one whose matcher failed (its copies share the engine's lexer, which the failure
        may have spent, so the next request compiles it afresh and fails where this one did, not sooner)."""
        with self._lock:
            self._templates.pop(key, None)


_ENGINES: weakref.WeakKeyDictionary[Any, dict[frozenset[int], GrammarEngine]] = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def grammar_engine(tokenizer: Any, eos_ids: Iterable[int]) -> GrammarEngine:
    """The engine of a tokenizer, built once per tokenizer object (llguidance's tokenizer takes ~1 s to build)
    and shared by every decoder over it, so its compiled grammars are shared too."""
    eos = frozenset(int(e) for e in eos_ids)
    with _ENGINES_LOCK:
        per_tokenizer = _ENGINES.setdefault(tokenizer, {})
        engine = per_tokenizer.get(eos)
        if engine is None:
            engine = per_tokenizer[eos] = GrammarEngine(tokenizer, eos)
        return engine


# ---------------------------------------------------------------- one request's matcher


class GrammarState:
    """A request's matcher, kept at its accepted output plus a speculative run of draft tokens.

    `speculate(draft)` advances through the draft and returns how many of its tokens the grammar allows;
    `masks()` are the masks of every verify position of that run; `settle(accepted, next_token)` rolls the
    matcher back to the accepted prefix (llguidance's rollback) and consumes the target's token. The matcher
    is never left advanced past tokens that were not accepted. EOS is never consumed: it ends the request.

    Once the engine fails (`failure` is set), the state is inert: every token is allowed in its masks, nothing is
    pushed, forced or settled, and the decoder ends the request with the failure as its error.
    """

    def __init__(
        self, matcher: LLMatcher, words: int, eos_ids: frozenset[int], on_fail: Callable[[], None] | None = None
    ):
        self.matcher = matcher
        self._on_fail = on_fail  # told once when the engine gives up (GrammarEngine.forget)
        self.words = words
        self.eos_ids = eos_ids
        self.pending: list[int] = []  # speculative tokens consumed since the last settle (no EOS among them)
        self.ended = False  # a speculative EOS: nothing is allowed after it
        self.settled = 0  # output tokens the matcher has taken (accepted ones and the target's)
        self.failure: str | None = None  # why the engine gave up mid-decode (no engine dump); None while it works
        self._masks = torch.empty((0, words), dtype=torch.int32)  # mask at depth d = after d pending tokens
        self._computed = 0

    def _fail(self) -> None:
        """The engine gave up: records why and makes the state inert (see the class docstring)."""
        if self.failure is None:
            self.failure = (
                f"response_format: the grammar engine gave up after {self.settled} output tokens: "
                f"{engine_reason(self.matcher.get_error())}; {TOO_COMPLEX}"
            )
            if self._on_fail is not None:
                self._on_fail()
        self.pending, self.ended, self._computed = [], False, 0

    # -- masks

    def mask(self) -> torch.Tensor:
        """The allowed-token bitmask [words] at the current (speculative) position."""
        if self.failure is not None:
            return torch.full((self.words,), ALL_ALLOWED, dtype=torch.int32)
        depth = len(self.pending)
        if self._computed <= depth:
            if self._masks.shape[0] <= depth:
                grown = torch.empty((max(8, 2 * (depth + 1)), self.words), dtype=torch.int32)
                grown[: self._computed] = self._masks[: self._computed]
                self._masks = grown
            row = self._masks[depth]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if self.matcher.is_error():
                self._fail()
                return self.mask()
            self._computed = depth + 1
        return self._masks[depth]

    def masks(self) -> torch.Tensor:
        """Masks [len(pending) + 1, words] of the speculative run's positions, the last after the whole run."""
        self.mask()
        if self.failure is not None:
            return torch.full((1, self.words), ALL_ALLOWED, dtype=torch.int32)
        return self._masks[: len(self.pending) + 1]

    def allows(self, token: int) -> bool:
        if self.ended or self.failure is not None:
            return False
        return _bit(self.mask(), token) and self.failure is None

    # -- speculation

    def push(self, token: int) -> bool:
        """Consumes a draft token speculatively if the grammar allows it here; False (state unchanged) if not, or
        when the engine fails on it (`failure`)."""
        if not self.allows(token):
            return False
        if token in self.eos_ids:
            self.ended = True  # accepted EOS ends the request, so the matcher needs nothing past it
            return True
        if not self.matcher.consume_token(token):
            self._fail()
            return False
        self.pending.append(token)
        return True

    def speculate(self, draft: Sequence[int]) -> int:
        """Makes the speculative run the longest prefix of draft the grammar allows, and returns its length.
        What is already pushed and agrees with draft is kept (a draft model pushes while it drafts)."""
        if self.failure is not None:
            return 0
        same = 0
        while same < len(draft) and self._in_run(same, draft[same]):
            same += 1
        self._truncate(same)
        for j in range(same, len(draft)):
            if not self.push(draft[j]):
                return j
        return len(draft)

    def _in_run(self, j: int, token: int) -> bool:
        """Whether the speculative run has token at position j."""
        if j < len(self.pending):
            return self.pending[j] == token
        return self.ended and j == len(self.pending) and token in self.eos_ids

    def _truncate(self, n: int) -> None:
        """Keeps the first n tokens of the speculative run."""
        if self.failure is not None:
            return
        if n <= len(self.pending):
            self.ended = False
        extra = len(self.pending) - n
        if extra > 0:
            if not self.matcher.rollback(extra):
                self._fail()
                return
            del self.pending[n:]
            self._computed = min(self._computed, n + 1)

    def forced(self, limit: int) -> list[int]:
        """The chain of tokens that are each the only one the grammar allows at their position (at most
        limit), pushed speculatively. A forced EOS ends the chain."""
        chain: list[int] = []
        while len(chain) < limit and not self.ended and self.failure is None:
            token = _single(self.mask())
            if token is None or not self.push(token):
                break
            chain.append(token)
        return [] if self.failure is not None else chain

    def settle(self, accepted: int, next_token: int | None) -> None:
        """Keeps the first `accepted` speculative tokens, rolls back the rest, then consumes next_token (the
        target's token after the accepted run; an EOS, or None, consumes nothing)."""
        if self.failure is not None:
            return
        eos_accepted = self.ended and accepted > len(self.pending)  # the request ends there: next_token is moot
        self._truncate(min(accepted, len(self.pending)))
        if self.failure is not None:
            return
        self.settled += len(self.pending)
        self.pending = []
        self.ended = False
        self._computed = 0
        if next_token is not None and next_token not in self.eos_ids and not eos_accepted:
            if not self.matcher.consume_token(next_token):
                self._fail()
                return
            self.settled += 1

    # -- where the grammar is

    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar (EOS is allowed)."""
        return self.matcher.is_accepting()

    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return self.matcher.is_stopped()


def _bit(mask: torch.Tensor, token: int) -> bool:
    word = token >> 5
    if word >= mask.shape[0]:
        return False
    return bool((int(mask[word]) >> (token & 31)) & 1)


def _single(mask: torch.Tensor) -> int | None:
    """The token when exactly one is allowed, else None."""
    words = mask.numpy()
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    w = int(words[nonzero[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(nonzero[0]) * 32 + w.bit_length() - 1


# ---------------------------------------------------------------- masking logits


def _forbidden(bits: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Bitmask [..., words] int32 -> [..., vocab] on device, nonzero where a token is not allowed (tokens past
    the bitmask, such as a model's padding rows, are not allowed)."""
    if device.type == "cpu":
        packed = np.invert(bits.contiguous().view(torch.uint8).numpy())  # little-endian: byte i = tokens 8i..8i+7
        forbidden = torch.from_numpy(np.unpackbits(packed, axis=-1, bitorder="little"))
    else:
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        forbidden = ((bits.to(device, non_blocking=True).unsqueeze(-1) >> shifts) & 1).eq(0).flatten(-2)
    have = forbidden.shape[-1]
    if have >= vocab:
        return forbidden[..., :vocab]
    return torch.nn.functional.pad(forbidden, (0, vocab - have), value=1)


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmask [..., words] int32 -> allowed [..., vocab] bool (on the bitmask's device)."""
    return _forbidden(bits, vocab, bits.device).eq(0)


def apply_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """-inf where a token is not allowed, in place. logits [..., V] (any float dtype, CPU or CUDA);
    bits [..., words] int32 (moved to logits' device). Returns logits."""
    forbidden = _forbidden(bits, logits.shape[-1], logits.device)
    # 0 -> -0.0, which adds nothing; 1 -> -3e38 * 2, which overflows to -inf. An add is several times faster
    # than masked_fill over a [B, k + 1, V] block on a CPU.
    bias = forbidden.to(torch.float32).mul_(-3.0e38).mul_(2.0)
    return logits.add_(bias.to(logits.dtype))


def stack_masks(states: Sequence[GrammarState | None], width: int, words: int) -> torch.Tensor:
    """Per-row masks of every verify position, [B, width, words] int32: a row's speculative-run masks, then
    all-allowed (positions past a row's run are never used, and an all-allowed mask keeps them finite)."""
    out = torch.full((len(states), width, words), ALL_ALLOWED, dtype=torch.int32)
    for b, state in enumerate(states):
        if state is not None:
            m = state.masks()[:width]
            out[b, : m.shape[0]] = m
    return out


def mask_next(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """Masks each constrained row's logits [B, V] with the mask at its matcher's current (speculative)
    position, in place: what a draft model drafts from. Rows whose state is None are left as they are."""
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    bits = torch.stack([states[b].mask() for b in rows])  # type: ignore[union-attr]
    idx = torch.tensor(rows, device=logits.device)
    masked = apply_bitmask(logits[idx], bits)
    # a draft model whose vocabulary has none of the allowed tokens drafts uniformly among them (any
    # distribution it samples from keeps rejection sampling exact)
    dead = torch.isinf(masked).all(dim=-1)
    if bool(dead.any()):
        masked[dead] = apply_bitmask(torch.zeros_like(masked[dead]), bits[dead.cpu()])
    logits[idx] = masked
    return logits


def mask_logits(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """Masks the rows that have a grammar, in place: position j of row b gets the mask of the j-th position of
    its speculative run. logits [B, width, V]; rows whose state is None are left as they are. Returns logits."""
    rows = [b for b, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    words = states[rows[0]].words  # type: ignore[union-attr]
    bits = stack_masks([states[b] for b in rows], logits.shape[1], words)
    if len(rows) == len(states):
        return apply_bitmask(logits, bits)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = apply_bitmask(logits[idx], bits)
    return logits
