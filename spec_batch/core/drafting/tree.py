"""Draft trees (EAGLE-2, arXiv 2406.16858): several continuations verified in one target forward.

A tree draft of a row is its tokens in an order where every parent comes before its children, and `parents[i]`,
the index of token i's parent among them (-1: the root, the row's last token, which the step reads first). The
target reads [root, tokens...] at once: each position attends to the cache and to its ancestors in the tree only,
at position (row's next position + depth), so every node's logits are what plain decoding would compute after the
path to it (the attention masks out the other branches exactly: core/kv/kv_batch.KVBatch.forward_tree).

Verification walks from the root (`walk`): at each node the target's own choice (greedy: its argmax) is looked up
among the node's children; a child with it is accepted and the walk goes on from there, otherwise that choice is the
step's next token. The accepted path is then what a chain with those tokens would have given: the decoder keeps
the path's cache columns and hidden states, and reads the path's logits (`path_logits`) for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each token (a child of the root: 1)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        assert p < i, f"token {i}'s parent {p} does not come before it"
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestors(parents: Sequence[int], width: int) -> torch.Tensor:
    """[width, width] bool over the step's input positions (0: the root, i + 1: token i): position q sees position c
    when c is q itself or an ancestor of it. Positions past the tree (padding) see only themselves."""
    out = torch.eye(width, dtype=torch.bool)
    out[: len(parents) + 1, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            out[i + 1] |= out[p + 1]
    return out


@dataclass
class TreeInput:
    """The verify forward's tree layout for a batch: attend [B, w, w] (ancestors) and depth [B, w] (root 0): a
    position's place in the sequence is the row's next position + its depth."""

    attend: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def of(cls, parents: Sequence[Sequence[int]], width: int, device: torch.device) -> TreeInput:
        attend = torch.stack([ancestors(p, width) for p in parents])
        depth = torch.zeros((len(parents), width), dtype=torch.long)
        for b, p in enumerate(parents):
            if p:
                depth[b, 1 : len(p) + 1] = torch.tensor(depths(p))
        return cls(attend.to(device), depth.to(device))


def walk(
    tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], choices: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """Greedy verification of tree drafts. choices [B, w]: the target's token after each input position.
    Returns per row the input positions of the accepted path (the root's 0 first) and the token after it."""
    picks = choices.tolist()
    paths, next_tokens = [], []
    for row_tokens, row_parents, row_picks in zip(tokens, parents, picks):
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(row_parents, row_tokens))}
        path, node = [0], -1
        while True:
            child = children.get((node, row_picks[node + 1]))
            if child is None:
                break
            node = child
            path.append(node + 1)
        paths.append(path)
        next_tokens.append(row_picks[path[-1]])
    return paths, next_tokens


def path_logits(logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, w, V] -> [B, longest path, V]: each row's logits along its path (padded with its last position)."""
    longest = max(len(p) for p in paths)
    index = torch.tensor([list(p) + [p[-1]] * (longest - len(p)) for p in paths], device=logits.device)
    return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def path_keep(paths: Sequence[Sequence[int]], width: int, device: torch.device) -> torch.Tensor:
    """[B, w] bool: the input positions on each row's accepted path (the cache columns to keep)."""
    keep = torch.zeros((len(paths), width), dtype=torch.bool)
    for b, p in enumerate(paths):
        keep[b, list(p)] = True
    return keep.to(device)


def best_nodes(scores: Sequence[float], parents: Sequence[int], n: int) -> list[int]:
    """EAGLE-2's re-ranking: the n nodes of highest score (a path's summed log-probability), parents first. A child
    never scores above its parent, so the choice holds every chosen node's ancestors (ties go to the shallower)."""
    d = depths(parents)
    chosen = sorted(range(len(scores)), key=lambda i: (-scores[i], d[i], i))[:n]
    return sorted(chosen, key=lambda i: (d[i], i))


def subtree(tokens: Sequence[int], parents: Sequence[int], chosen: Sequence[int]) -> tuple[list[int], list[int]]:
    """The chosen nodes (ancestor-closed, parents first) as a tree draft of their own: tokens and re-indexed parents."""
    index = {node: i for i, node in enumerate(chosen)}
    return [tokens[c] for c in chosen], [index[parents[c]] if parents[c] >= 0 else -1 for c in chosen]


def reaches(parents: Sequence[int], rates: Sequence[float]) -> list[float]:
    """P(the walk reaches node i) from each node's chance to be accepted once its parent was: the product along
    its path. Siblings exclude each other, so a tree's expected accepted tokens is the sum of its nodes' reaches."""
    out: list[float] = []
    for p, r in zip(parents, rates):
        out.append(r * (out[p] if p >= 0 else 1.0))
    return out


def checked(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[bool | None]:
    """Against the tokens a greedy step emitted (the accepted path, then the target's next token), each node's
    verdict: True / False where its parent is on the emitted path (so the target's token after the parent is known)
    and it matched it or not, None where that is unknown. Nodes the step did not verify are judged too: the
    target's choice after a matched parent is the same whether or not the node was in the verified tree."""
    d = depths(parents)
    out: list[bool | None] = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        known = d[i] <= len(emitted) and (p < 0 or out[p] is True)
        out.append(t == emitted[d[i] - 1] if known else None)
    return out
