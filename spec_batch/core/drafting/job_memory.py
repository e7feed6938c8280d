"""A job's memory: the outputs of its requests, finished and in flight, in one suffix index, so that the
suffix drafter can draft one request from the others. Bounded in tokens; one per job, dropped when it ends."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from .native_suffix_index import new_suffix_index
from .suffix_index import SuffixDraft

DEFAULT_MAX_DEPTH = 48  # trie depth: match length + draft length fit in it


class JobMemory:
    """A job's outputs, finished and in flight, in one index; the oldest outputs are dropped whole once the
    index holds more than max_tokens. Safe to share between threads; one per job, dropped when the job ends."""

    def __init__(self, max_tokens: int = 50_000, max_depth: int = DEFAULT_MAX_DEPTH):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index = new_suffix_index(max_depth)
        self._order: OrderedDict[int, None] = OrderedDict()  # sequence ids, oldest first
        self._next_id = 0
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """A finished output (for example one of the job's stored outputs, to warm the memory)."""
        key = self.open()
        self.extend(key, tokens)
        self.close(key)

    def open(self) -> int:
        """A new output in flight; returns its key for extend and close."""
        with self._lock:
            key = self._next_id
            self._next_id += 1
            self._order[key] = None
            return key

    def extend(self, key: int, tokens: Sequence[int]) -> None:
        """Appends an output's new tokens (ignored once the output was evicted)."""
        if not tokens:
            return
        with self._lock:
            if key not in self._order:
                return
            self.index.extend(key, tokens)
            while self.index.num_tokens > self.max_tokens and len(self._order) > 1:
                oldest = next(iter(self._order))
                if oldest == key:  # never the output being written; the next oldest goes instead
                    oldest = list(self._order)[1]
                del self._order[oldest]
                self.index.remove(oldest)

    def close(self, key: int) -> None:
        with self._lock:
            self.index.close(key)

    def draft(self, context: Sequence[int], max_tokens: int, **kwargs) -> SuffixDraft:
        with self._lock:
            return self.index.draft(context, max_tokens=max_tokens, **kwargs)

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    def __len__(self) -> int:
        return len(self._order)
