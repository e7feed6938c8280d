"""A suffix index of token sequences for suffix drafting (SuffixDecoding, arXiv 2411.04975).

The index is a trie of bounded depth over every suffix start of every sequence it holds: the path of the
string w counts the places where w occurs (`count(w)`), so after the longest suffix of a context that occurs
with a continuation, the next token is the most frequent one and its count-based probability is its share.

Why our own code and not a library. The drafter needs, all at once: incremental appends (a row grows by a few
tokens every step), several sequences in one index, removal of a whole sequence (the job memory's token cap),
and occurrence counts per continuation. pydivsufsort and pysais build static suffix arrays (every append and
every removal is a rebuild; counts per next token need a scan of the suffix-array range); the `suffix-tree`
package builds a static generalized suffix tree without appends to a sequence, removal or counts; Arctic
Inference's C++ tree does all of it but ships as a source build tied to vLLM and a torch version. A bounded
trie does it in ~150 lines with each append touching at most `max_depth` nodes, the same trade-off Arctic
Inference makes.

Memory. A trie of depth D over N tokens has up to N * D nodes; here a path that only one suffix start takes
is kept as a `_Tail` (a reference into its sequence, count 1) rather than a chain of nodes, and is split only
when a second occurrence arrives. Nodes are spent only on repeated content: O(N + repeated tokens * D). A node
whose count drops back to 1 after a removal stays a node (correct, slightly less compact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("children", "count")

    def __init__(self, count: int):
        self.count = count  # suffix starts whose path passes through (or ends at) this node
        self.children: dict[int, _Node | _Tail] = {}


class _Tail:
    """The rest of one suffix start's path, below a node: seq[pos : min(start + depth, len(seq))], count 1.

    It grows by itself as its sequence grows (nothing else shares it), so appends never touch it."""

    __slots__ = ("pos", "seq", "start")

    def __init__(self, seq: int, start: int, pos: int):
        self.seq, self.start, self.pos = seq, start, pos


@dataclass
class SuffixDraft:
    """A continuation: tokens, each token's count-based probability given the tokens before it, and the
    length of the context suffix it continues."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted length if the probabilities were right: sum of the cumulative products."""
        total, alive = 0.0, 1.0
        for p in self.probs:
            alive *= p
            total += alive
        return total


# a position in the trie: (node, None, 0) at a node, or (node, tail, i) after i tokens of a tail below node
_State = tuple[_Node, "_Tail | None", int]


class SuffixQueries:
    """The queries a suffix index answers, checked once for both implementations (this module's trie and the C++
    one, native_suffix_index.py); each supplies the unchecked `_count`, `_next_counts`, `_draft`."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth

    def count(self, tokens: Sequence[int]) -> int:
        """How many times `tokens` (at most max_depth of them) occurs in the indexed sequences."""
        if len(tokens) > self.max_depth:
            raise ValueError(f"at most max_depth={self.max_depth} tokens, got {len(tokens)}")
        return self._count(tokens)

    def next_counts(self, tokens: Sequence[int]) -> dict[int, int]:
        """Occurrences of tokens + [t] for each t that follows (len(tokens) < max_depth)."""
        if len(tokens) >= self.max_depth:
            raise ValueError(f"fewer than max_depth={self.max_depth} tokens, got {len(tokens)}")
        return self._next_counts(tokens)

    def draft(
        self,
        context: Sequence[int],
        *,
        max_tokens: int,
        max_match: int,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> SuffixDraft:
        """The most frequent continuation of the longest matching suffix, token by token; stops at max_tokens,
        at max_spec_factor * match length, or when the cumulative probability falls below min_token_prob."""
        return self._draft(context, max_tokens, max_match, max_spec_factor, min_token_prob)

    def _count(self, tokens: Sequence[int]) -> int:
        raise NotImplementedError

    def _next_counts(self, tokens: Sequence[int]) -> dict[int, int]:
        raise NotImplementedError

    def _draft(
        self, context: Sequence[int], max_tokens: int, max_match: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        raise NotImplementedError


class SuffixIndex(SuffixQueries):
    """Sequences of token ids, indexed for the longest-match and count queries of suffix drafting."""

    def __init__(self, max_depth: int = 48):
        super().__init__(max_depth)
        self._root = _Node(0)
        self._seqs: dict[int, list[int]] = {}
        # per open sequence: suffix starts whose path still grows and ends at a node (not in a tail)
        self._growing: dict[int, dict[int, _Node]] = {}
        self.num_tokens = 0

    # ------------------------------------------------------------------ updates

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Appends tokens to a sequence (created if new); each token touches at most max_depth nodes."""
        if seq_id not in self._seqs:
            self._seqs[seq_id] = []
            self._growing[seq_id] = {}
        elif seq_id not in self._growing:
            raise ValueError(f"sequence {seq_id} was closed")
        for token in tokens:
            self._append(seq_id, int(token))

    def close(self, seq_id: int) -> None:
        """No more tokens for this sequence: frees its growth bookkeeping."""
        self._growing.pop(seq_id, None)

    def remove(self, seq_id: int) -> None:
        """Drops a sequence: every suffix start's path loses one count; subtrees left at zero are pruned."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        for start in range(len(seq)):
            node = self._root
            node.count -= 1
            end = min(start + self.max_depth, len(seq))
            pos = start
            while pos < end:
                child = node.children[seq[pos]]
                if isinstance(child, _Tail):  # the rest of this path is this start's own
                    del node.children[seq[pos]]
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[seq[pos]]
                    break
                node, pos = child, pos + 1
        self.num_tokens -= len(seq)
        del self._seqs[seq_id]
        self._growing.pop(seq_id, None)

    def _append(self, seq_id: int, token: int) -> None:
        seq = self._seqs[seq_id]
        growing = self._growing[seq_id]
        n = len(seq)  # the new token's position
        seq.append(token)  # tails of this sequence's starts grow with it
        self.num_tokens += 1
        self._root.count += 1
        growing[n] = self._root
        for start, node in list(growing.items()):
            child = node.children.get(token)
            if child is None:
                node.children[token] = _Tail(seq_id, start, n)
                del growing[start]
                continue
            if isinstance(child, _Tail):
                child = self._split(node, child)
            child.count += 1
            if n + 1 - start < self.max_depth:
                growing[start] = child
            else:
                del growing[start]

    def _split(self, parent: _Node, tail: _Tail) -> _Node:
        """A second path arrives at a tail's first token: that token becomes a node (count 1 until the caller
        adds its own), and the tail keeps the rest."""
        seq = self._seqs[tail.seq]
        node = _Node(1)
        parent.children[seq[tail.pos]] = node
        tail.pos += 1
        if tail.pos < min(tail.start + self.max_depth, len(seq)):
            node.children[seq[tail.pos]] = tail
        elif tail.seq in self._growing and len(seq) - tail.start < self.max_depth:
            self._growing[tail.seq][tail.start] = node  # its path ends here now and still grows
        return node

    # ------------------------------------------------------------------ queries

    def _walk(self, tokens: Sequence[int]) -> _State | None:
        node, tail, i = self._root, None, 0
        for token in tokens:
            if tail is None:
                child = node.children.get(token)
                if child is None:
                    return None
                if isinstance(child, _Tail):
                    tail, i = child, 1
                else:
                    node = child
            else:
                seq = self._seqs[tail.seq]
                pos = tail.pos + i
                if pos >= min(tail.start + self.max_depth, len(seq)) or seq[pos] != token:
                    return None
                i += 1
        return node, tail, i

    def _next(self, state: _State) -> tuple[int, float, _State] | None:
        """The most frequent next token (ties: the smallest id), its share of the continuations, the new state."""
        node, tail, i = state
        if tail is not None:
            seq = self._seqs[tail.seq]
            pos = tail.pos + i
            if pos >= min(tail.start + self.max_depth, len(seq)):
                return None
            return seq[pos], 1.0, (node, tail, i + 1)
        if not node.children:
            return None
        total, best_token, best_count, best_child = 0, -1, 0, None
        for token, child in node.children.items():
            c = 1 if isinstance(child, _Tail) else child.count
            total += c
            if c > best_count or (c == best_count and token < best_token):
                best_token, best_count, best_child = token, c, child
        # the share is of the occurrences that continue: the context's own occurrence at the end of its
        # sequence has no next token and must not dilute the others
        if isinstance(best_child, _Tail):
            return best_token, best_count / total, (node, best_child, 1)
        return best_token, best_count / total, (best_child, None, 0)

    def _count(self, tokens: Sequence[int]) -> int:
        state = self._walk(tokens)
        if state is None:
            return 0
        node, tail, _ = state
        return 1 if tail is not None else node.count

    def _next_counts(self, tokens: Sequence[int]) -> dict[int, int]:
        state = self._walk(tokens)
        if state is None:
            return {}
        node, tail, _i = state
        if tail is not None:
            step = self._next(state)
            return {step[0]: 1} if step else {}
        return {t: 1 if isinstance(c, _Tail) else c.count for t, c in node.children.items()}

    def longest_match(self, context: Sequence[int], max_match: int) -> tuple[int, _State | None]:
        """The longest suffix of context (<= max_match tokens) that occurs followed by a token.

        Shorter suffixes of a match match too, so a binary search over the length finds it."""
        lo, hi = 0, min(max_match, len(context), self.max_depth - 1)
        best: _State | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            state = self._walk(context[len(context) - mid :])
            if state is not None and self._next(state) is not None:
                lo, best = mid, state
            else:
                hi = mid - 1
        return lo, best

    def _draft(
        self, context: Sequence[int], max_tokens: int, max_match: int, max_spec_factor: float, min_token_prob: float
    ) -> SuffixDraft:
        match_len, state = self.longest_match(context, max_match)
        out = SuffixDraft(match_len=match_len)
        limit = min(max_tokens, int(match_len * max_spec_factor + 1e-9))
        alive = 1.0
        while state is not None and len(out.tokens) < limit:
            step = self._next(state)
            if step is None:
                break
            token, prob, state = step
            alive *= prob
            if alive < min_token_prob:
                break
            out.tokens.append(token)
            out.probs.append(prob)
        return out

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def node_count(self) -> int:
        """Nodes in the trie (tails excluded): what the index costs beyond its sequences."""
        total, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            total += 1
            stack.extend(c for c in node.children.values() if isinstance(c, _Node))
        return total
