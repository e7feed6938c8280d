"""The learned head as a drafter (core/heads/head.py): it drafts a chain from the target's hidden states of the accepted
positions, which the decoder hands it from the forward that already ran (no second target forward).

Per row the head's cache holds pairs (f_t, x_{t+1}): the target's hidden state at position t and the token after
it. `pending[b]` holds the target's states the head has not read yet: they pair with the row's last tokens (the
last pending state is the one at the position before the row's last token). Drafting reads every pending pair
(one ragged forward), then feeds its own predicted feature with each drafted token. Those predicted entries are
never kept: after verification they are rolled back (`feedback`) and the target's real states of the accepted
positions arrive instead (`observe_hidden`): a rejected draft's state never feeds the head, and the head's cache
shrinks and grows with the target's, by the same masked rollback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..drafting.chain_draft import DraftVocab, chain_draft
from ..drafting.drafter_registry import HEAD
from ..drafting.drafters import Draft, DraftRow
from ..drafting.drafters import NodeRate as NodeRate  # its home is drafters.py (GrowsTrees)
from ..drafting.job_memory import JobMemory
from ..kv.kv_batch import KVBatch
from .head import EagleHead


class HeadDrafter:
    has_probs = True
    free = False
    wants_hidden = True  # the decoder captures the target's last hidden states for `observe_hidden`
    initial_acceptance = (1.0, 2.0)
    default_tree_width = HEAD.default_tree_width  # `tree_width` where none is given (docs/heads.md "Draft trees")

    def __init__(self, head: EagleHead, name: str, device: torch.device, placeholder_id: int, vocab_size: int):
        self.head = head
        # which target states the decoder captures: None, the last (after the final norm); else these layers
        self.hidden_layers = tuple(head.config.target_layers) or None
        self.name = name
        self.device = device
        self.placeholder_id = placeholder_id
        self.vocab_size = vocab_size  # the target's: the head's distributions are spread over it (0 outside d2t)
        self.kv = KVBatch(head, device, 0)
        self.pending: list[torch.Tensor] = []  # per row: [m, H] target states not yet read
        self.fed: list[int] = []  # per row: predicted entries this step's draft left in the cache

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        # empty cache rows; the new rows' prompt states come through observe_hidden and are read when drafting
        self.kv.add_empty_rows(len(rows))
        hidden, dtype = self.head.feature_width, self.head.dtype
        self.pending.extend(torch.zeros(0, hidden, dtype=dtype, device=self.device) for _ in rows)
        self.fed.extend(0 for _ in rows)

    def observe_hidden(self, first_row: int, states: Sequence[torch.Tensor]) -> None:
        """The target's last hidden states [n_b, H] of row first_row + i's newly accepted positions, in order."""
        for i, s in enumerate(states):
            b = first_row + i
            self.pending[b] = torch.cat([self.pending[b], s.to(self.pending[b].dtype)], dim=0)

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        # a row drafts once the head has the target's state before its last token (a 1-token prompt waits a step)
        return [k_max if len(p) else 0 for p in self.pending]

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        first = self._pending_input(rows)
        last_features: list[torch.Tensor] = []

        def next_logits(j: int, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            features = first[2] if j == 0 else last_features[-1]
            out = self.kv.forward_output(ids, valid, logits_to_keep=1, features=features, raw=j == 0)
            last_features.append(out.features[:, -1:])  # [B, 1, H] f^ of the next position, fed with its token
            return out.logits[:, -1]  # [B, Vd]

        vocab = DraftVocab(self.head.d2t, self.vocab_size)
        chain, k = chain_draft(rows, k, first[:2], next_logits, self.placeholder_id, self.device, vocab)
        if chain.forwards:  # the first forward read every row's pending pairs (without a draft they wait)
            self.pending = [p[:0] for p in self.pending]
        self.fed = [max(0, kb - 1) for kb in k]
        return Draft(tokens=chain.tokens, probs=chain.probs, forwards=chain.forwards)

    def propose_tree(
        self,
        rows: Sequence[DraftRow],
        k: Sequence[int],
        width: int,
        rate: NodeRate | None = None,
        floor: float = 0.0,
        grow: Callable[[list[float]], bool] | None = None,
    ) -> Draft:
        """EAGLE-2's dynamic tree (arXiv 2406.16858), for greedy rows without bias, penalties or a grammar: from the
        root, the `width` likeliest tokens; at each further depth the `width` nodes likeliest to be reached are fed
        in one forward and each proposes its `width` likeliest children, up to depth k[b]. Returns every node grown
        (parents first) with its confidence (the head's probability of it after its parent); which of them the step
        verifies is the policy's choice (planning.plan_step). rate(b, depth, confidence): a node's calibrated chance
        to be accepted once its parent was (None: the confidence itself); a node's reach is the product along its
        path, and a node reached with less than `floor` grows no children (no use verifying them); grow(reaches of
        the nodes a row would feed) says whether its next level is worth a head forward (None: always). width 1 is
        the greedy chain. Each node is fed with its parent's predicted feature, seeing the row's cache and its own
        ancestors only; like a chain's, the fed entries are dropped at `feedback`."""
        batch = len(rows)
        out, first_column, next_pos, nodes = self._tree_root(rows, k, width, rate)
        fed, forwards = [0] * batch, 1
        for depth in range(1, max(k, default=0)):
            beams = [n.beam(depth, width, floor) if depth < kb else [] for n, kb in zip(nodes, k)]
            beams = [b if grow is None or not b or grow([n.reach[i] for i in b]) else [] for n, b in zip(nodes, beams)]
            if not any(beams):
                break
            ids, valid, feats, hidden = self._level_input(nodes, beams, width, first_column, out.features)
            positions = (next_pos + depth - 1).unsqueeze(1).expand(batch, width)
            attend = torch.eye(width, dtype=torch.bool, device=self.device).expand(batch, -1, -1)
            column = self.kv.length
            out = self.kv.forward_tree(
                ids.to(self.device),
                valid.to(self.device),
                positions,
                attend,
                hidden_columns=hidden.to(self.device),
                features=feats,
                raw=False,
            )
            forwards += 1
            probs, top_ids = _top(out.logits, width)
            for b, beam in enumerate(beams):
                fed[b] += len(beam)
                for i, node in enumerate(beam):
                    nodes[b].column[node] = column + i
                    nodes[b].expand(node, probs[b][i], top_ids[b][i], out.features[b, i])
        self.fed = fed
        return self._tree_draft(nodes, forwards)

    def _tree_root(self, rows: Sequence[DraftRow], k: Sequence[int], width: int, rate: NodeRate | None):
        """The first head forward over the rows' pending pairs: each drafting row's `width` likeliest roots."""
        ids, valid, features = self._pending_input(rows)
        out = self.kv.forward_output(ids, valid, logits_to_keep=1, features=features, raw=True)
        self.pending = [p[:0] for p in self.pending]
        first_column, next_pos = self.kv.length, self.kv.next_pos.clone()  # the depth-1 nodes' position
        nodes = [_Nodes(b, rate) for b in range(len(rows))]
        probs, ids = _top(out.logits[:, -1:], width)
        for b in range(len(rows)):
            if k[b]:
                nodes[b].expand(-1, probs[b][0], ids[b][0], out.features[b, -1])
        return out, first_column, next_pos, nodes

    def _tree_draft(self, nodes: list[_Nodes], forwards: int) -> Draft:
        """The grown nodes as a Draft in the target's token ids."""
        d2t = self.head.d2t.tolist()
        return Draft(
            tokens=[[d2t[t] for t in n.tokens] for n in nodes],
            parents=[list(n.parent) for n in nodes],
            confidence=[list(n.confidence) for n in nodes],
            forwards=forwards,
        )

    def _level_input(
        self, nodes: list[_Nodes], beams: list[list[int]], width: int, first_column: int, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The nodes a tree level feeds: ids [B, width], valid [B, width], their parents' predicted features
        [B, width, H], and the cache columns each must not see [B, width, L] (of the tree's, all but its ancestors)."""
        batch = len(nodes)
        ids = torch.full((batch, width), self.placeholder_id, dtype=torch.long)
        valid = torch.zeros((batch, width), dtype=torch.bool)
        feats = features.new_zeros((batch, width, features.shape[-1]))
        hidden = torch.ones((batch, width, self.kv.length), dtype=torch.bool)
        hidden[:, :, :first_column] = False  # the rows' real entries; of the tree's, a node sees its ancestors
        for b, beam in enumerate(beams):
            for i, node in enumerate(beam):
                ids[b, i], valid[b, i], feats[b, i] = nodes[b].tokens[node], True, nodes[b].feature[node]
                for column in nodes[b].ancestor_columns(node):
                    hidden[b, i, column] = False
        return ids, valid, feats, hidden

    def _pending_input(self, rows: Sequence[DraftRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row's unread pairs, right-aligned: ids [B, w] (token t+1), valid [B, w], features [B, w, H]."""
        width = max(1, max(len(p) for p in self.pending))
        hidden = self.head.feature_width
        dtype = self.pending[0].dtype if self.pending else torch.float32
        ids = torch.full((len(rows), width), self.placeholder_id, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        features = torch.zeros((len(rows), width, hidden), dtype=dtype, device=self.device)
        for b, (row, p) in enumerate(zip(rows, self.pending)):
            m = len(p)
            if m:
                ids[b, width - m :] = torch.tensor(row.tokens[-m:], dtype=torch.long)
                valid[b, width - m :] = True
                features[b, width - m :] = p
        return ids.to(self.device), valid.to(self.device), features

    def feedback(self, rows: Sequence[DraftRow], k: Sequence[int], accepted: Sequence[int]) -> None:
        # the predicted entries go whatever was accepted: the target's real states of the accepted positions
        # replace them (observe_hidden)
        if any(self.fed):
            self.kv.rollback(torch.tensor(self.fed, dtype=torch.long, device=self.device))
            self.kv.maybe_compact()
        self.fed = [0] * len(self.fed)

    def keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.kv, self.pending, self.fed = KVBatch(self.head, self.device, 0), [], []
            return
        self.kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.pending = [self.pending[i] for i in keep]
        self.fed = [self.fed[i] for i in keep]


def _top(logits: torch.Tensor, width: int) -> tuple[list, list]:
    """logits [B, n, Vd] -> per row and position the `width` likeliest draft ids and their probabilities."""
    probs, ids = logits.float().softmax(dim=-1).topk(width, dim=-1)
    return probs.tolist(), ids.tolist()


class _Nodes:
    """Row b's tree while it grows: per node its draft-vocabulary token, parent (-1: the root), confidence (the
    head's probability of it after its parent), reach (core/drafting/tree.reaches: the product of its path's rates), depth,
    the head's predicted feature it is fed with (its parent's output), and its cache column once fed."""

    def __init__(self, row: int, rate: NodeRate | None) -> None:
        self.row, self.rate = row, rate
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.confidence: list[float] = []
        self.reach: list[float] = []
        self.feature: list[torch.Tensor] = []
        self.depth: list[int] = []
        self.column: dict[int, int] = {}

    def expand(self, parent: int, probs: list[float], ids: list[int], feature: torch.Tensor) -> None:
        """The parent's likeliest children (their probabilities and draft ids), fed with its output feature [H]."""
        depth = 1 if parent < 0 else self.depth[parent] + 1
        above = 1.0 if parent < 0 else self.reach[parent]
        for p, t in zip(probs, ids):
            self.tokens.append(t)
            self.parent.append(parent)
            self.confidence.append(p)
            self.reach.append(above * (p if self.rate is None else self.rate(self.row, depth, p)))
            self.feature.append(feature)
            self.depth.append(depth)

    def beam(self, depth: int, width: int, floor: float) -> list[int]:
        """The `width` nodes at this depth likeliest to be reached (at least `floor`): the ones fed to grow the next."""
        at = [i for i, d in enumerate(self.depth) if d == depth and self.reach[i] >= floor]
        return sorted(at, key=lambda i: -self.reach[i])[:width]

    def ancestor_columns(self, node: int) -> list[int]:
        out, p = [], self.parent[node]
        while p >= 0:
            out.append(self.column[p])
            p = self.parent[p]
        return out
