"""The learned head as a drafter (core/head.py): it drafts a chain from the target's hidden states of the accepted
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

from collections.abc import Sequence

import torch

from .chain_draft import DraftVocab, chain_draft
from .drafters import Draft, DraftRow
from .head import EagleHead
from .job_memory import JobMemory
from .kv_batch import KVBatch


class HeadDrafter:
    has_probs = True
    free = False
    wants_hidden = True  # the decoder captures the target's last hidden states for `observe_hidden`
    initial_acceptance = (1.0, 2.0)

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

    def admit(self, rows: Sequence[DraftRow]) -> None:
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

    def use_memory(self, memory: JobMemory) -> None:
        pass
