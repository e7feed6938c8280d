"""The suffix index in C++ where the native kernels are loaded (loading/kernels/suffix_trie.cpp), with
`SuffixIndex`'s interface and answers: the drafters ask `new_suffix_index` for one and get the Python trie
elsewhere (no compiler, `SPEC_BATCH_COMPILE=off`, or before any model loaded the kernels).

Why: the Python trie costs ~6 us a token (dict updates, node splits), about 1 ms a request for a 180-token
prompt and its output, paid by every row the drafter looks at. At 16 server clients, where drafting rarely pays,
that was ~1% of the engine's time; the C++ trie takes ~0.7-1 us a token, the call from Python included. Both are
checked against the same brute-force oracle (tests/core/test_suffix_index.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .suffix_index import SuffixDraft, SuffixIndex, SuffixQueries

_trie_class: Any = None  # torch.classes.spec_batch.SuffixTrie once found (the kernels may load after this module)


def _native_class() -> Any:
    global _trie_class
    if _trie_class is None:
        torch = sys.modules.get("torch")
        if torch is None:  # no model loaded, so no kernels: a process that only queues or reads keeps torch out
            return None
        try:
            _trie_class = torch.classes.spec_batch.SuffixTrie
        except (AttributeError, RuntimeError):  # not registered (yet): the kernels are not loaded
            return None
    return _trie_class


class NativeSuffixIndex(SuffixQueries):
    """SuffixIndex's interface over the C++ trie (the queries' checks are SuffixQueries', shared)."""

    def __init__(self, max_depth: int, trie_class: Any):
        super().__init__(max_depth)
        self._trie = trie_class(max_depth)

    @property
    def num_tokens(self) -> int:
        return self._trie.num_tokens()

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        try:
            self._trie.extend(seq_id, [int(t) for t in tokens])
        except RuntimeError as exc:  # the C++ invalid_argument
            raise ValueError(str(exc).splitlines()[0]) from exc

    def close(self, seq_id: int) -> None:
        self._trie.close(seq_id)

    def remove(self, seq_id: int) -> None:
        self._trie.remove(seq_id)

    def _count(self, tokens: Sequence[int]) -> int:
        return self._trie.count([int(t) for t in tokens])

    def _next_counts(self, tokens: Sequence[int]) -> dict[int, int]:
        nexts, counts = self._trie.next_counts([int(t) for t in tokens])
        return dict(zip(nexts, counts))

    def _draft(
        self, context: Sequence[int], max_tokens: int, max_match: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        match_len, tokens, probs = self._trie.draft(
            [int(t) for t in context], max_tokens, max_match, float(max_spec_factor), float(min_token_prob)
        )
        return SuffixDraft(tokens=tokens, probs=probs, match_len=match_len)

    def node_count(self) -> int:
        return self._trie.node_count()

    def __contains__(self, seq_id: int) -> bool:
        return self._trie.contains(seq_id)

    def __len__(self) -> int:
        return self._trie.size()


AnySuffixIndex = SuffixIndex | NativeSuffixIndex


def new_suffix_index(max_depth: int) -> AnySuffixIndex:
    """The C++ trie where the kernels are loaded, else the Python one: the same answers either way."""
    trie_class = _native_class()
    return SuffixIndex(max_depth) if trie_class is None else NativeSuffixIndex(max_depth, trie_class)
