"""Drafters: what proposes tokens for the target to check.

A drafter sees the rows of the batch (each row's token list ends with the token the target will read next)
and proposes up to k[b] tokens per row. Drafters that sample from a distribution return it too, so the
verifier can run rejection sampling; drafters without one (n-gram) are verified as one-hot drafts.
New kinds (suffix trees, EAGLE/Medusa heads) implement the same protocol; the decoding loop does not change:
everything it needs to know about a drafter is in the protocol's attributes (`free`, `has_probs`,
`initial_acceptance`), never in its name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..kv.kv_batch import KVBatch, left_padded
from ..params import SamplingParams
from .chain_draft import chain_draft
from .drafter_registry import DEFAULT_DRAFT_TOKENS as DEFAULT_DRAFT_TOKENS  # its home is the registry
from .drafter_registry import NGRAM, NONE, DraftSettings
from .job_memory import JobMemory


class DraftRow(Protocol):
    """What a drafter may read of a row in flight."""

    tokens: list[int]  # prompt + generated; the last is the next token the target reads
    params: SamplingParams
    seed: int
    n_generated: int  # output position of the next token to be produced


@dataclass
class Draft:
    tokens: list[list[int]]  # per row, at most k[b] tokens
    probs: torch.Tensor | None = None  # [B, kmax, V] the draft's distributions, or None (one-hot drafts)
    forwards: int = 0  # draft-model forward passes spent
    # per row, one confidence in [0, 1] per proposed token (the drafter's estimate that the target agrees), or None
    confidence: list[list[float]] | None = None
    # per row, each token's parent among them (-1: the row's last token): a tree (core/drafting/tree.py); None: chains
    parents: list[list[int]] | None = None


class Drafter(Protocol):
    name: str
    has_probs: bool  # True: proposals are sampled from `Draft.probs` (rejection sampling applies)
    # True: proposing costs nothing (no model forward). The loop then asks for the full proposal every step, to
    # observe acceptance even in steps that verify none of it, and the policy never drafts just to probe.
    free: bool
    # (first_hits, first_tries): the prior of a new row's RowAcceptance (its first-token acceptance rate)
    initial_acceptance: tuple[float, float]

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        """New rows join the batch, appended after the current ones; memory: the job memory they may draft from
        (their job's other outputs; None: none, e.g. online requests). Drafters with no use for it ignore it."""

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        """How many tokens each row could be offered now (cheap; the policy uses it)."""

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        """Up to k[b] draft tokens per row."""

    def feedback(self, rows: Sequence[DraftRow], k: Sequence[int], accepted: Sequence[int]) -> None:
        """After verification: rows accepted accepted[b] of the k[b] proposed tokens (before tokens are appended)."""

    def keep_rows(self, keep: list[int]) -> None:
        """Only these row indices stay in the batch, in this order (also called with none: the batch drained)."""

    # Optional capabilities are the protocols below (`ReadsHidden`, `GrowsTrees`), checked with isinstance, so
    # drafters without them need no change.


@runtime_checkable
class ReadsHidden(Protocol):
    """A drafter that reads the target's hidden states (a learned head, core/heads/head_drafter.py). With `wants_hidden`
    true, the decoder captures them in the forwards it runs anyway (prefill, verify) and calls `observe_hidden`."""

    wants_hidden: bool
    hidden_layers: Sequence[int] | None  # the target layers read (None: the last hidden state, after the final norm)

    def observe_hidden(self, first_row: int, states: Sequence[torch.Tensor]) -> None:
        """states[i] [n_i, H]: row first_row + i's newly accepted positions (after a step: the step's input token
        and its accepted drafts; after admit: the prompt but its last token)."""


# (row, depth, the drafter's probability of a node after its parent) -> P(the node accepted | its parent was)
NodeRate = Callable[[int, int, float], float]


@runtime_checkable
class GrowsTrees(Protocol):
    """A drafter that grows draft trees (core/drafting/tree.py): asked for greedy rows at small batches when the decoder's
    tree width is above 1 (planning.plan_step); other drafters draft chains."""

    def propose_tree(
        self,
        rows: Sequence[DraftRow],
        k: Sequence[int],
        width: int,
        rate: NodeRate | None = None,
        floor: float = 0.0,
        grow: Callable[[list[float]], bool] | None = None,
    ) -> Draft:
        """Every node grown per row (parents first), with `parents` and `confidence` set."""


class NoDrafter:
    """Plain decoding through the same loop: the baseline speedups are measured against."""

    name = NONE.name
    has_probs = False
    free = True
    initial_acceptance = (1.0, 2.0)

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        pass

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        return [0] * len(rows)

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        return Draft(tokens=[[] for _ in rows])

    def feedback(self, rows, k, accepted) -> None:
        pass

    def keep_rows(self, keep: list[int]) -> None:
        pass


class _NgramIndex:
    """Latest end position of every n-gram (n in [n_min, n_max]) of one row, updated incrementally."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Continuation (<= k tokens) of the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens) - 1  # the suffix ends here; index n-grams ending strictly before it
        for i in range(self.indexed, end):
            for n in range(self.n_min, min(self.n_max, i + 1) + 1):
                self.last_end[tuple(tokens[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end)
        for n in range(min(self.n_max, end + 1), self.n_min - 1, -1):
            pos = self.last_end.get(tuple(tokens[end - n + 1 : end + 1]))
            if pos is not None:
                return tokens[pos + 1 : pos + 1 + k]
        return []


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

    name = NGRAM.name
    has_probs = False
    free = True
    # its proposals are checked against every step's output anyway, so a new row starts skeptical and earns long
    # drafts by matching (free-form text then never pays for a wide verify)
    initial_acceptance = (0.2, 2.0)

    def __init__(self, n_min: int = 1, n_max: int = 3):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.indexes: list[_NgramIndex] = []
        self._cached: list[list[int]] = []

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        self.indexes.extend(_NgramIndex(self.n_min, self.n_max) for _ in rows)

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        self._cached = [index.lookup(row.tokens, k_max) for index, row in zip(self.indexes, rows)]
        return [len(c) for c in self._cached]

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        if len(self._cached) != len(rows):
            self.available(rows, max(k, default=0))
        return Draft(tokens=[c[:kb] for c, kb in zip(self._cached, k)])

    def feedback(self, rows, k, accepted) -> None:
        self._cached = []

    def keep_rows(self, keep: list[int]) -> None:
        self.indexes = [self.indexes[i] for i in keep]
        self._cached = []


def none_factory(settings: DraftSettings) -> Callable[[], Drafter]:
    """The registry's maker of the "none" kind."""
    return NoDrafter


def ngram_factory(settings: DraftSettings) -> Callable[[], Drafter]:
    """The registry's maker of the "ngram" kind; checks the sizes now, not at the first decode."""
    n_min, n_max = settings.ngram_min, settings.ngram_max
    NgramDrafter(n_min, n_max)
    return lambda: NgramDrafter(n_min, n_max)


class ModelDrafter:
    """A smaller causal LM sharing the target's tokenizer; keeps its own KV cache, rolled back like the target's."""

    has_probs = True
    free = False
    initial_acceptance = (1.0, 2.0)

    def __init__(self, model, name: str, device: torch.device, placeholder_id: int, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size  # the target's: draft rows past it are padding and never proposed
        self.name = name
        self.device = device
        self.placeholder_id = placeholder_id
        self.input_rows = model.get_input_embeddings().weight.shape[0]
        self.kv = KVBatch(model, device, 0)
        self.seen: list[int] = []  # per row: how many of row.tokens the draft cache holds

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        group = KVBatch(self.model, self.device, len(rows))
        prefill = [row.tokens[:-1] for row in rows]  # the last token is read when drafting, like the target
        ids, valid = left_padded(prefill, self.placeholder_id, self.device)
        group.forward(self._feedable(ids), valid, logits_to_keep=1)
        self.kv.extend(group)
        self.seen.extend(len(p) for p in prefill)

    def _feedable(self, ids: torch.Tensor) -> torch.Tensor:
        # a target token past the draft's embedding rows (a padding row) would crash the draft; it only
        # costs the draft's guess quality, never exactness, to show it the placeholder instead
        ids = ids.to(self.device)
        return torch.where(ids < self.input_rows, ids, torch.full_like(ids, self.placeholder_id))

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        return [k_max] * len(rows)

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        batch = len(rows)
        # first forward: every token of the row the draft has not read yet (ragged; left placeholders)
        unseen = [rows[b].tokens[self.seen[b] :] if k[b] > 0 else [] for b in range(batch)]
        first = left_padded(unseen, self.placeholder_id, self.device)

        def next_logits(j: int, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            logits = self.kv.forward(self._feedable(ids), valid, logits_to_keep=1)[:, -1]  # [B, Vd]
            return _to_vocab(logits, self.vocab_size)  # [B, V]

        chain, k = chain_draft(rows, k, first, next_logits, self.placeholder_id, self.device)
        for b in range(batch):
            if k[b] > 0:
                self.seen[b] = len(rows[b].tokens) + k[b] - 1
        return Draft(tokens=chain.tokens, probs=chain.probs, forwards=chain.forwards)

    def feedback(self, rows: Sequence[DraftRow], k: Sequence[int], accepted: Sequence[int]) -> None:
        # the cache holds row.tokens + the first k-1 drafts; keep only the accepted ones
        drop = [0] * len(rows)
        for b in range(len(rows)):
            if k[b] > 0:
                kept = min(accepted[b], k[b] - 1)
                drop[b] = (k[b] - 1) - kept
                self.seen[b] = len(rows[b].tokens) + kept
        self.kv.rollback(torch.tensor(drop, dtype=torch.long, device=self.device))
        self.kv.maybe_compact()

    def keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.kv, self.seen = KVBatch(self.model, self.device, 0), []
            return
        self.kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.seen = [self.seen[i] for i in keep]


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Cuts padding rows off, or pads with -inf (never proposed) up to the target's vocabulary."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
