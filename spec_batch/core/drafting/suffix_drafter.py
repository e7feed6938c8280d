"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): each row's own prompt + output, and the outputs of the
other requests of its job, indexed by `SuffixIndex`; a row is offered the most frequent continuation of the
longest suffix of its tokens that occurred before, with a count-based confidence per draft token.

In a bulk job the requests are independent: the job memory only changes what is drafted, never an output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import InvalidParameterError
from .drafter_registry import SUFFIX, DraftSettings
from .drafters import Draft, DraftRow
from .job_memory import DEFAULT_MAX_DEPTH, JobMemory
from .native_suffix_index import AnySuffixIndex, new_suffix_index
from .suffix_index import SuffixDraft


@dataclass
class _RowState:
    row: DraftRow  # the admitted row: its tokens are the accepted ones (what the indexes take)
    index: AnySuffixIndex  # this row's prompt + output
    seen: int  # tokens of row.tokens in `index`
    prompt_len: int
    memory: JobMemory | None  # its job's memory (None: drafts from its own tokens only)
    memory_key: int | None  # this row's output in the job memory


class SuffixDrafter:
    """Proposes, per row, the better of two continuations (higher expected accepted length, then the longer
    match): one from the row's own prompt + output, one from the job memory. No model forward: it is free."""

    name = SUFFIX.name
    has_probs = False
    free = True
    # like the n-gram drafter: every step checks the proposal for free, so a row starts skeptical and earns
    # long drafts by matching
    initial_acceptance = (0.2, 2.0)
    OPTIONS = SUFFIX.options  # what a user may tune (load_decoder's drafter_options)
    # num_draft_tokens when the caller gives none (the registry's default and its reason: core/drafting/drafter_registry.py)
    default_draft_tokens = SUFFIX.default_draft_tokens
    # max_spec_factor: a draft is at most this x its match length. 2, not SuffixDecoding's 1: once a verify of
    # several tokens costs little more than one (loading/cpu_linear.py), copying after a short match pays
    # (edits +4-6%, templated b1 +2%, b8 -2%: docs/benchmarks.md); the policy still trims each row by confidence.

    def __init__(
        self,
        *,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_spec_factor: float = 2.0,
        min_token_prob: float = 0.1,
    ):
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._rows: list[_RowState] = []
        self._cached: list[SuffixDraft] = []

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        """memory: the rows' job memory; each row's output goes into it as it grows, and it drafts from it."""
        if memory is not None and memory.index.max_depth != self.max_depth:
            raise ValueError(f"the job memory's depth {memory.index.max_depth} differs from max_depth={self.max_depth}")
        for row in rows:
            prompt_len = len(row.tokens) - row.n_generated
            key = memory.open() if memory is not None else None
            self._rows.append(_RowState(row, new_suffix_index(self.max_depth), 0, prompt_len, memory, key))
        self._cached = []

    def _sync(self, state: _RowState) -> None:
        tokens = state.row.tokens
        if state.seen < len(tokens):
            state.index.extend(0, tokens[state.seen :])
            if state.memory is not None and state.memory_key is not None:
                state.memory.extend(state.memory_key, tokens[max(state.seen, state.prompt_len) :])
            state.seen = len(tokens)

    def _draft(self, state: _RowState, view: DraftRow, max_tokens: int) -> SuffixDraft:
        """view: the row as the loop shows it (under a grammar it already ends with its forced tokens)."""
        if max_tokens <= 0:
            return SuffixDraft()
        self._sync(state)
        options = dict(
            max_match=max(1, self.max_depth - max_tokens),
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
        )
        context = view.tokens[-self.max_depth :]
        best = state.index.draft(context, max_tokens=max_tokens, **options)
        if state.memory is not None:
            shared = state.memory.draft(context, max_tokens, **options)
            if (shared.score, shared.match_len) > (best.score, best.match_len):
                best = shared
        return best

    def available(self, rows: Sequence[DraftRow], k_max: int) -> list[int]:
        self._cached = [self._draft(state, view, k_max) for state, view in zip(self._rows, rows)]
        return [len(d.tokens) for d in self._cached]

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> Draft:
        if len(self._cached) != len(rows):
            self.available(rows, max(k, default=0))
        return Draft(
            tokens=[d.tokens[:kb] for d, kb in zip(self._cached, k)],
            confidence=[d.probs[:kb] for d, kb in zip(self._cached, k)],
        )

    def feedback(self, rows: Sequence[DraftRow], k: Sequence[int], accepted: Sequence[int]) -> None:
        self._cached = []

    def keep_rows(self, keep: list[int]) -> None:
        kept = set(keep)
        for b, state in enumerate(self._rows):
            if b not in kept and state.memory is not None and state.memory_key is not None:
                self._sync(state)  # the last step's tokens, EOS included, go into the job memory too
                state.memory.close(state.memory_key)
        self._rows = [self._rows[i] for i in keep]
        self._cached = []


def suffix_factory(settings: DraftSettings) -> Callable[[], SuffixDrafter]:
    """The registry's maker of the "suffix" kind: the user's options (names checked by the registry) tried now,
    not at the first decode."""
    options = dict(settings.options)
    try:
        SuffixDrafter(**options)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"drafter_options for {SUFFIX.name!r} {options}: {exc}") from exc
    return lambda: SuffixDrafter(**options)
