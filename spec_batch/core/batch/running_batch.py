"""The batch in flight: the target's KV batch, the drafter and the rows, in cache order. It admits rows (their
prompts prefilled, the drafter told), runs steps, hands each row's tokens to the row's sink, and drops the rows
that finished or were cancelled. `Decoder.generate` and `Decoder.stream` drive one on the caller's thread; the
engine (core/engine.py) drives one on its own thread for every caller. Joining, stepping and leaving are the same
calls in both, so a row's tokens do not depend on who drives the batch nor on when the row joined.

One step (`step`): draft (planning.plan_step) -> target input (verify.verify_input) -> one target forward ->
verify (verify.verify) -> roll the caches back -> append each row's tokens (Row.append: EOS, stop strings, budget)
-> each row's update to its sink -> the finished rows leave.

Rows of a job carry the job's memory (`Row.memory`), handed to the drafter as they join: a job's rows draft from
its other requests' outputs, an online request from its own tokens only. A `plain` row drafts nothing (the baseline
speedups are measured against, decoded in the same steps as everything else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from ..argmax import last_argmax
from ..drafting.drafters import Draft, Drafter
from ..drafting.job_memory import JobMemory
from ..drafting.tree import TreeInput, path_keep, path_logits, walk
from ..heads.hidden import capture_hidden, hidden_reader
from ..kv.kv_batch import KVBatch, left_padded
from ..logits_processing import shape_logits
from ..logprobs import step_logprobs
from ..outputs import GenerationResult, RequestStats, StreamChunk, TokenLogprob
from ..params import fresh_seed
from ..policy import RowAcceptance
from ..text import OutputText
from ..verify import verify, verify_input
from .grammar_step import GrammarStep
from .planning import observe_proposal, observe_tree, plan_step
from .rows import Row, fill_order

if TYPE_CHECKING:
    from ..decoder import Decoder, Request


@dataclass
class RowUpdate:
    """One step of one row: the text and tokens it added (`chunk`); `result` is set on the row's last update."""

    chunk: StreamChunk
    result: GenerationResult | None = None


Sink = Callable[[RowUpdate], None]
S = TypeVar("S", bound=Sink)


@dataclass
class _Event:
    row: Row
    new_ids: list[int]  # output tokens this step added (after cuts)
    finished: bool


class RunningBatch(Generic[S]):
    """The rows decoding together, each with the sink that hears of its tokens (S: the driver's sink type, so the
    engine can read its tickets back from `sinks`). Not thread-safe: its driver holds `Decoder.exclusive()` around
    each call."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.rows: list[Row] = []
        self.sinks: list[S] = []
        self.kv = self._new_kv(0)
        self.drafter: Drafter = decoder.drafter_factory()

    def __len__(self) -> int:
        return len(self.rows)

    def _new_kv(self, rows: int) -> KVBatch:
        """The target's KV batch: the one place it is made (a drained batch's and a prefill group's alike)."""
        return KVBatch(self.decoder.target, self.decoder.device, rows)

    # ---------------------------------------------------------------- joining

    def new_row(self, request: Request, memory: JobMemory | None = None, plain: bool = False) -> Row:
        """A request's row, not yet in the batch (admit it, or `end` it where it never joins)."""
        index, ids, params, grammar = request.index, request.ids, request.params, request.grammar
        first_hits, first_tries = self.drafter.initial_acceptance
        return Row(
            index=index,
            prompt_len=len(ids),
            tokens=list(ids),
            params=params,
            seed=params.seed if params.seed is not None else fresh_seed(),
            text=OutputText(self.decoder.tokenizer, params.stop, self.decoder.eos_ids),
            acceptance=RowAcceptance(first_hits=first_hits, first_tries=first_tries),
            stats=RequestStats(prompt_tokens=len(ids)),
            grammar=grammar,
            memory=memory,
            plain=plain,
        )

    def admit(self, rows: Sequence[Row], sinks: Sequence[S]) -> None:
        """New rows join below the ones in the batch: their prompts are cached in one forward and the drafter is told,
        with each row's memory (a head drafter also gets the prompts' hidden states)."""
        first_row = len(self.rows)
        states = self._prefill(rows)
        start = 0
        for end in range(1, len(rows) + 1):  # runs of rows that share a memory join the drafter together
            if end == len(rows) or rows[end].memory is not rows[start].memory:
                self.drafter.admit(rows[start:end], rows[start].memory)
                start = end
        reader = hidden_reader(self.drafter)
        if states is not None and reader is not None:
            reader.observe_hidden(first_row, states)
        self.rows.extend(rows)
        self.sinks.extend(sinks)

    def _prefill(self, rows: Sequence[Row]) -> list[torch.Tensor] | None:
        """Caches every prompt token but the last, which the first step reads together with the first draft.
        For a drafter that reads hidden states (a head), also returns each row's states [n_b, W] of those tokens."""
        reader = hidden_reader(self.drafter)
        hidden = reader is not None
        group = self._new_kv(len(rows))
        ids, valid = left_padded([row.tokens[:-1] for row in rows], self.decoder.placeholder_id, self.decoder.device)
        with capture_hidden(self.decoder.target, hidden, reader.hidden_layers if reader else None) as states:
            group.forward(ids, valid, logits_to_keep=1)
        self.kv.extend(group)
        width = ids.shape[1]
        return [states[-1][b, width - len(row.tokens) + 1 :] for b, row in enumerate(rows)] if hidden else None

    # ---------------------------------------------------------------- leaving

    def end(self, positions: Sequence[int], reason: str = "cancelled") -> None:
        """The rows at these positions end now (their tokens so far; `reason` as finish_reason) and leave."""
        if not positions:
            return
        rows, sinks, gone = self.rows, self.sinks, set(positions)
        self._keep(fill_order([b for b in range(len(rows)) if b not in gone]))
        for b in positions:
            end_row(rows[b], sinks[b], reason)

    def fail(self, error: str, code: str) -> None:
        """Every row ends with finish_reason "error" (after a step that raised: the batch is not usable any more). No
        row in the batch has had its result yet: a step drops its finished rows before it delivers."""
        for row, sink in zip(self.rows, self.sinks):
            sink(RowUpdate(StreamChunk("", [], "error", row.stats), failed_result(row.stats, error, code)))
        self.rows, self.sinks = [], []

    def _keep(self, keep: list[int]) -> None:
        """Only these rows stay, in this order: their caches and drafts follow. A drained batch starts afresh."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in keep]
        self.sinks = [self.sinks[b] for b in keep]
        self.drafter.keep_rows(keep)  # also when none stays: the drafter sees its rows' last tokens
        if keep:
            self.kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.decoder.device))
        else:
            self.kv = self._new_kv(0)
            self.drafter = self.decoder.drafter_factory()

    # ---------------------------------------------------------------- one step

    def step(self) -> int:
        """One step of every row: each sink hears of its row's new tokens (the result too, once finished); the
        finished rows leave. Returns how many rows the step decoded."""
        if self.decoder.threads is not None:
            self.decoder.threads.tick()  # the CPU threads other processes leave free, on this thread
        events, sinks = self._step(), self.sinks
        self._keep(fill_order([b for b, e in enumerate(events) if not e.finished]))
        for event, sink in zip(events, sinks):
            deliver(event.row, sink, event.new_ids, event.finished)
        return len(events)

    def _step(self) -> list[_Event]:
        decoder, rows, kv, drafter, policy = self.decoder, self.rows, self.kv, self.drafter, self.decoder.policy
        started = decoder.clock.start()
        # forced tokens for rows that speculate (a plain row, or the `none` drafter, stays plain decoding)
        grammar = GrammarStep(rows, force=[policy.k_max > 0 and not r.plain for r in rows])
        room = [0 if r.plain else n for r, n in zip(rows, grammar.room)]
        draft, proposed = plan_step(drafter, policy, grammar.views, room, clock=decoder.clock)
        draft = grammar.extend(draft)  # forced chain + draft, cut where the grammar forbids (trees: no grammar)
        ids, valid = verify_input([r.tokens[-1] for r in rows], draft.tokens, decoder.placeholder_id, decoder.device)
        tree = TreeInput.of(draft.parents, ids.shape[1], decoder.device) if draft.parents is not None else None
        # bias and penalties at each position from the tokens before it, then the grammar's mask
        reader = hidden_reader(drafter)
        with capture_hidden(
            decoder.target, reader is not None, reader.hidden_layers if reader else None
        ) as hidden:  # [B, 1 + k, H] for a head drafter
            if tree is None:
                out = kv.forward(ids, valid)
            else:
                out = kv.forward_tree(ids, valid, kv.next_pos.unsqueeze(1) + tree.depth, tree.attend).logits
            logits = grammar.mask(shape_logits(out, rows, draft.tokens))  # [B, 1 + k, V]
        drafted = [len(d) for d in draft.tokens]  # verified tokens (a tree's nodes)
        if tree is None:
            chains = draft.tokens
            accepted, next_tokens = verify(rows, chains, draft.probs, logits, decoder.placeholder_id)
            positions: list[list[int]] = [list(range(a + 1)) for a in accepted]
        else:  # greedy rows only (planning.plan_step): the accepted path is a chain from here on
            positions, next_tokens = walk(draft.tokens, draft.parents, last_argmax(logits))  # type: ignore[arg-type]
            chains = [[d[i - 1] for i in p[1:]] for d, p in zip(draft.tokens, positions)]
            accepted = [len(c) for c in chains]
            logits = path_logits(logits, positions)
        logprobs = step_logprobs(rows, logits, chains, accepted, next_tokens)
        drafter.feedback(grammar.views, grammar.drafted(draft.tokens), grammar.drafter_accepted(accepted))
        if hidden and reader is not None:  # only the accepted positions' states (input token, accepted drafts)
            reader.observe_hidden(0, [hidden[-1][b, p] for b, p in enumerate(positions)])
        grammar.settle(accepted, next_tokens)
        if tree is None:
            dropped = [n - a for n, a in zip(drafted, accepted)]
            if any(dropped):  # a step with nothing to forget pays no tensor calls
                kv.rollback(torch.tensor(dropped, device=decoder.device))
        else:
            kv.keep_last(path_keep(positions, ids.shape[1], decoder.device))
        kv.maybe_compact()

        events = self._append(grammar, draft, proposed, chains, drafted, accepted, next_tokens, logprobs)
        seconds = decoder.clock.step(started, len(rows), drafted)
        policy.observe_step(len(rows), drafted, seconds, emitted=sum(accepted) + len(rows))
        return events

    def _append(
        self,
        grammar: GrammarStep,
        draft: Draft,
        proposed: Draft,
        chains: list[list[int]],
        drafted: list[int],
        accepted: list[int],
        next_tokens: list[int],
        logprobs: list[list[TokenLogprob] | None],
    ) -> list[_Event]:
        """Each row's verified tokens appended (its statistics, and what the policy learns of its proposal); a row
        whose grammar engine gave up ends with its output so far, alone."""
        policy, events = self.decoder.policy, []
        confidence = proposed.confidence or [None] * len(self.rows)
        failures = grammar.failures
        for b, (row, d, n, a, conf, nxt, f, lp) in enumerate(
            zip(self.rows, chains, drafted, accepted, confidence, next_tokens, map(len, grammar.forced), logprobs)
        ):
            if failures[b] is not None:
                row.stats.record_step(0, 0, 0)
                row.fail_grammar(failures[b])
                events.append(_Event(row, [], True))
                continue
            emitted = d[:a] + [nxt]
            row.stats.record_step(n - f, a - f, draft.forwards)  # the drafter's own tokens (after forced ones)
            if proposed.parents is None:
                free = self.drafter.free
                observe_proposal(policy, row.acceptance, proposed.tokens[b], conf, emitted[f:], a - f, free)
            else:  # a grown tree (no grammar, so nothing forced): every node is judged, verified or not
                observe_tree(policy, row.acceptance, proposed.tokens[b], proposed.parents[b], conf, emitted)
            before = row.stats.output_tokens
            new_ids = row.append(emitted, lp)
            row.stats.forced_tokens += min(f, row.stats.output_tokens - before)
            events.append(_Event(row, new_ids, row.finished))
        return events


def deliver(row: Row, sink: Sink, new_ids: list[int], finished: bool) -> None:
    """A row's step to its sink: the text and tokens it added (nothing when a step added neither), and the result
    on its last update."""
    text = row.text.stream_chunk(finished)
    logprobs = row.output_logprobs(len(row.output_ids) - len(new_ids))
    if finished:
        sink(RowUpdate(StreamChunk(text, new_ids, row.finish_reason, row.stats, logprobs), row.result()))
    elif text or new_ids:
        sink(RowUpdate(StreamChunk(text, new_ids, logprobs=logprobs)))


def end_row(row: Row, sink: Sink, reason: str) -> None:
    """Ends a row now with its tokens so far (one in the batch, or one that never joined it) and tells its sink."""
    row.finish(reason)  # type: ignore[arg-type]
    deliver(row, sink, [], True)


def failed_result(stats: RequestStats, error: str, code: str) -> GenerationResult:
    """The result of a request whose decoding failed, not by its own fault."""
    return GenerationResult("", [], "error", stats, error=error, error_code=code)
