"""Output text: incremental detokenization, stop strings and EOS.

A request's text is built token by token, decoding a short window of ids each time rather than the whole
output (the prefix_offset / read_offset technique of vLLM's `detokenize_incrementally`). The window starts at
a point where the text so far ended with a complete character, so its text is exactly what the full decode
adds there: the result equals `tokenizer.decode(output_ids, skip_special_tokens=True)` for byte-level BPE and
sentencepiece tokenizers (tokenizers that rewrite spaces across tokens, `clean_up_tokenization_spaces`, are
not exact). Characters split over several tokens (UTF-8 bytes) appear once complete.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

INCOMPLETE = "\ufffd"  # what a decoder shows for the bytes of a character not complete yet


class IncrementalDetokenizer:
    """The text of a growing list of token ids; `text` holds everything whose characters are complete."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window decoded at each push starts here ...
        self._read_offset = 0  # ... and the text of the ids before this is in `text` already
        self.text = ""

    def push(self, token_id: int) -> None:
        """Appends one id; `text` grows by what it completes (nothing while a character is still split)."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        if len(window) > len(prefix) and not window.endswith(INCOMPLETE):
            self.text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def flush(self) -> None:
        """At the end of the output: adds what is held back too (an incomplete character decodes to U+FFFD)."""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._prefix_offset, self._read_offset)
            self.text += self._decode(self._prefix_offset, len(self._ids))[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True)


class OutputText:
    """One request's output text: where it ends (EOS, a stop string) and what has been streamed of it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], eos_ids: Collection[int]):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = list(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._eos_ids = eos_ids
        self._cut: int | None = None  # where a stop string begins, once one was found
        self._streamed = 0
        self.ended_by_eos = False

    @property
    def text(self) -> str:
        return self._detok.text if self._cut is None else self._detok.text[: self._cut]

    def add(self, token_id: int) -> bool:
        """Adds one output token. True when the output ends at it: it is an EOS (not part of the text, nor of
        the output ids) or it completes a stop string (the text ends before the stop string; the token is kept,
        so the output ids are the fewest whose text contains it)."""
        if token_id in self._eos_ids:
            self.ended_by_eos = True
            return True
        before = len(self._detok.text)
        self._detok.push(token_id)
        if self._stop and len(self._detok.text) > before:
            self._cut = self._find_stop(max(0, before - self._longest_stop + 1))
        return self._cut is not None

    def close(self) -> None:
        """The output ended (for any reason): the text becomes final."""
        if self._cut is None:
            self._detok.flush()

    def stream_chunk(self, finished: bool) -> str:
        """Text not streamed yet; before the end, holds back what could still turn out to begin a stop string."""
        text = self.text
        safe = len(text) if finished else max(self._streamed, len(text) - max(0, self._longest_stop - 1))
        chunk = text[self._streamed : safe]
        self._streamed = max(self._streamed, safe)
        return chunk

    def _find_stop(self, start: int) -> int | None:
        """Earliest position at or after start where a stop string begins (only new text can complete one)."""
        hits = [pos for pos in (self._detok.text.find(s, start) for s in self._stop) if pos >= 0]
        return min(hits) if hits else None


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends an output: the model's generation config and the tokenizer's EOS."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids
