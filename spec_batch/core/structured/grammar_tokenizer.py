"""The tokenizer bridge of structured output: a model's tokenizer as llguidance sees it (core/structured/grammar.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llguidance import LLTokenizer, TokenizerWrapper

from ...errors import InvalidParameterError


def llg_tokenizer(tokenizer: Any, eos_ids: Sequence[int]) -> LLTokenizer:
    """An llguidance tokenizer for a fast Hugging Face tokenizer, or for any tokenizer that exposes its
    vocabulary as bytes (`token_bytes`: one bytes per token id; the tests' tiny models)."""
    eos = sorted(eos_ids) or None
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is not None:
        return LLTokenizer(TokenizerWrapper(_ByteVocabulary(list(token_bytes), eos or [])), eos_token=eos)
    from transformers import PreTrainedTokenizerFast  # transformers is imported by the core anyway

    if isinstance(tokenizer, PreTrainedTokenizerFast):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    raise InvalidParameterError(
        f"response_format needs a fast (tokenizers-backed) tokenizer; {type(tokenizer).__name__} is not one"
    )


class _ByteVocabulary:
    """What llguidance's TokenizerWrapper reads: token bytes, EOS, and an encoder (greedy longest match)."""

    def __init__(self, tokens: list[bytes], eos_ids: list[int]):
        self.tokens = tokens
        self.eos_token_id = eos_ids[0] if eos_ids else len(tokens)
        self.bos_token_id = None
        self.special_token_ids = list(eos_ids)
        self._ids = {t: i for i, t in enumerate(tokens) if t and i not in eos_ids}
        self._longest = max((len(t) for t in self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i : i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                i += 1  # a byte no token spells cannot be produced: skip it
        return out
