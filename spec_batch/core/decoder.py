"""The speculative decoding loop: prefill, draft, one target forward over all drafts, verify, roll back, stop.

Rows join the batch as others finish (continuous batching) and leave when done; each row has its own
accepted length every step, and nothing a row does changes another row's tokens. One step (`_step`):
draft (planning.plan_step) -> target input (verify.verify_input) -> one target forward -> verify (verify.verify) ->
roll the caches back -> append each row's tokens (Row.append: EOS, stop strings, budget).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ChatTemplateError, InvalidParameterError, PromptTooLongError
from .drafters import Drafter, NoDrafter
from .grammar import GrammarState
from .grammar_step import GrammarStep, row_grammar
from .hidden import capture_hidden, hidden_layers, wants_hidden
from .inputs import Prompt, params_list, prompt_ids
from .job_memory import JobMemory
from .kv_batch import KVBatch, left_padded, supports_model
from .logits_processing import shape_logits
from .logprobs import step_logprobs
from .outputs import GenerationResult, RequestStats, StreamChunk
from .padding import skips_padding
from .params import SamplingParams, fresh_seed
from .planning import observe_proposal, observe_tree, plan_step
from .policy import DraftPolicy, RowAcceptance
from .rows import Row
from .text import OutputText, eos_ids
from .tree import TreeInput, path_keep, path_logits, walk
from .verify import verify, verify_input

Request = tuple[int, list[int], SamplingParams, GrammarState | None]  # (index in the prompts, ids, params, matcher)


@dataclass
class _Event:
    row: Row
    new_ids: list[int]  # output tokens this step added (after cuts)
    finished: bool


class Results:
    """generate()'s results in prompt order; `finish` stores one and tells on_result."""

    def __init__(self, n: int, on_result: Callable[[int, GenerationResult], None] | None):
        self._results: list[GenerationResult | None] = [None] * n
        self._on_result = on_result

    def finish(self, index: int, result: GenerationResult) -> None:
        self._results[index] = result
        if self._on_result is not None:
            self._on_result(index, result)

    @property
    def values(self) -> list[GenerationResult]:
        return self._results  # type: ignore[return-value]


class Decoder:
    """A target model, its tokenizer and a drafter. Thread-safe: one decode at a time per decoder.

    Build it with `load_decoder`. Attributes: tokenizer, target (HF model), target_name, draft_name,
    device, max_context (longest prompt + max_new_tokens the models accept), policy.
    """

    def __init__(
        self,
        target: Any,
        tokenizer: Any,
        *,
        target_name: str,
        drafter_factory: Callable[[], Drafter],
        draft_name: str,
        device: torch.device,
        max_context: int,
        num_draft_tokens: int = 8,
        adaptive: bool = True,
        chat_template: Callable[[list[dict]], list[int]] | None = None,
        tree_width: int = 1,
    ):
        why = supports_model(target)
        if why:
            raise InvalidParameterError(f"target {target_name!r}: {why}")
        self.target = target
        self.tokenizer = tokenizer
        self.target_name = target_name
        self.draft_name = draft_name
        self.device = device
        self.max_context = max_context
        self.chat_template = chat_template  # messages -> prompt ids; supplied by spec_batch.loading
        self._drafter_factory = drafter_factory
        self.policy = DraftPolicy(
            k_max=num_draft_tokens if draft_name != "none" else 0,
            adaptive=adaptive,
            ragged=skips_padding(target),
            tree_width=tree_width,
        )
        self._lock = threading.Lock()
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.eos_ids = eos_ids(target, tokenizer)
        self.placeholder_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # ---------------------------------------------------------------- public API

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        batch_size: int = 8,
        *,
        return_errors: bool = False,
        on_result: Callable[[int, GenerationResult], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        memory: JobMemory | None = None,
    ) -> list[GenerationResult]:
        """Decodes every prompt (str used as given, no chat template; or token ids).

        params: one SamplingParams for all prompts, or one per prompt. return_errors=False: a bad prompt
        raises before anything is decoded; True: that prompt alone gets finish_reason="error" with .error.
        on_result(index, result) is called as each request finishes.
        should_stop() is asked once per step (before it). Once it returns True, no further step runs: requests
        already finished keep their results, and every other one, in flight or still waiting, ends with
        finish_reason="cancelled", the text and tokens it has so far and its statistics (on_result is called
        for each of them too).
        memory: the job's memory (its requests' outputs), kept by the caller across calls for one job: drafters
        that use it (suffix) draft from the other requests' outputs too. It changes drafts, never outputs.
        """
        results = Results(len(prompts), on_result)
        requests = self._requests(prompts, params, batch_size, return_errors, results.finish)
        with self._lock, torch.inference_mode():
            for event in self._run(requests, batch_size, should_stop, memory):
                if event.finished:
                    results.finish(event.row.index, event.row.result())
        return results.values

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """One chunk per step with the tokens accepted in that step; the last carries finish_reason and stats.

        The decoder is locked per step, not for the whole stream, so an abandoned stream blocks nobody.
        """
        p = params or SamplingParams()
        events = self._run([self._request(0, prompt, p)], 1)
        while True:
            with self._lock, torch.inference_mode():
                event = next(events, None)
            if event is None:
                return
            row = event.row
            text = row.text.stream_chunk(event.finished)
            logprobs = row.output_logprobs(len(row.output_ids) - len(event.new_ids))
            if event.finished:
                yield StreamChunk(text, event.new_ids, row.finish_reason, row.stats, logprobs)
            elif text or event.new_ids:
                yield StreamChunk(text, event.new_ids, logprobs=logprobs)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the target's chat template applied to messages, with the generation prompt."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.target_name!r} was built without a chat template; pass prompts as text or ids"
            )
        return self.chat_template(messages)

    def without_speculation(self) -> Decoder:
        """The same engine and target with the `none` drafter: the baseline speedups are measured against."""
        return Decoder(
            self.target,
            self.tokenizer,
            target_name=self.target_name,
            drafter_factory=NoDrafter,
            draft_name="none",
            device=self.device,
            max_context=self.max_context,
            num_draft_tokens=0,
            chat_template=self.chat_template,
        )

    # ---------------------------------------------------------------- rows and the loop

    def _requests(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        batch_size: int,
        return_errors: bool,
        finish: Callable[[int, GenerationResult], None],
    ) -> list[Request]:
        """generate()'s arguments checked and its prompts' requests built (the engine's generate shares it): a bad
        prompt raises, or with return_errors finishes alone with finish_reason="error"."""
        if isinstance(prompts, (str, bytes)):
            raise InvalidParameterError("prompts must be a list of prompts; wrap a single prompt in a list")
        if batch_size < 1:
            raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list(params, len(prompts)))):
            try:
                requests.append(self._request(i, prompt, p))
            except (PromptTooLongError, InvalidParameterError) as exc:
                if not return_errors:
                    raise
                finish(i, GenerationResult("", [], "error", RequestStats(), error=str(exc)))
        return requests

    def _request(self, index: int, prompt: Prompt, params: SamplingParams) -> Request:
        """Checks a prompt and builds its matcher now, so a bad prompt or grammar fails before decoding."""
        ids = prompt_ids(
            prompt,
            params,
            index,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            model_name=self.target_name,
        )
        return index, ids, params, row_grammar(self.tokenizer, self.eos_ids, params)

    def _new_row(self, request: Request, drafter: Drafter) -> Row:
        index, ids, params, grammar = request
        first_hits, first_tries = drafter.initial_acceptance
        return Row(
            index=index,
            prompt_len=len(ids),
            tokens=list(ids),
            params=params,
            seed=params.seed if params.seed is not None else fresh_seed(),
            text=OutputText(self.tokenizer, params.stop, self.eos_ids),
            acceptance=RowAcceptance(first_hits=first_hits, first_tries=first_tries),
            stats=RequestStats(prompt_tokens=len(ids)),
            grammar=grammar,
        )

    def _new_drafter(self, memory: JobMemory | None) -> Drafter:
        drafter = self._drafter_factory()
        if memory is not None:
            drafter.use_memory(memory)
        return drafter

    def _run(
        self,
        requests: list[Request],
        batch_size: int,
        should_stop: Callable[[], bool] | None = None,
        memory: JobMemory | None = None,
    ) -> Iterator[_Event]:
        waiting = deque(requests)
        active: list[Row] = []
        kv = KVBatch(self.target, self.device, 0)
        drafter = self._new_drafter(memory)
        while waiting or active:
            if should_stop is not None and should_stop():
                for row in active + [self._new_row(request, drafter) for request in waiting]:
                    row.finish("cancelled")
                    yield _Event(row, [], True)
                return
            if waiting and len(active) < batch_size:
                group = [
                    self._new_row(waiting.popleft(), drafter)
                    for _ in range(min(batch_size - len(active), len(waiting)))
                ]
                self._admit(kv, drafter, group, len(active))
                active.extend(group)
            events = self._step(kv, drafter, active)
            yield from events
            if any(e.finished for e in events):
                keep = [b for b, e in enumerate(events) if not e.finished]
                active = [active[b] for b in keep]
                drafter.keep_rows(keep)  # also when none stays: the drafter sees its rows' last tokens
                if active:
                    kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
                else:
                    kv = KVBatch(self.target, self.device, 0)
                    drafter = self._new_drafter(memory)

    def _admit(self, kv: KVBatch, drafter: Drafter, rows: list[Row], first_row: int) -> None:
        """New rows join below the first_row rows already in kv: their prompts are cached and the drafter told (a
        head drafter also gets the prompts' hidden states). The engine's batch joins rows the same way."""
        states = self._prefill(kv, rows, drafter)
        drafter.admit(rows)
        if states is not None:
            drafter.observe_hidden(first_row, states)  # type: ignore[attr-defined]

    def _prefill(self, kv: KVBatch, rows: list[Row], drafter: Drafter) -> list[torch.Tensor] | None:
        """Caches every prompt token but the last, which the first step reads together with the first draft.
        For a drafter that reads hidden states (a head), also returns each row's states [n_b, W] of those tokens."""
        hidden = wants_hidden(drafter)
        group = KVBatch(self.target, self.device, len(rows))
        ids, valid = left_padded([row.tokens[:-1] for row in rows], self.placeholder_id, self.device)
        with capture_hidden(self.target, hidden, hidden_layers(drafter)) as states:
            group.forward(ids, valid, logits_to_keep=1)
        kv.extend(group)
        width = ids.shape[1]
        return [states[-1][b, width - len(row.tokens) + 1 :] for b, row in enumerate(rows)] if hidden else None

    def _step(self, kv: KVBatch, drafter: Drafter, rows: list[Row]) -> list[_Event]:
        t0 = time.perf_counter()
        grammar = GrammarStep(rows, force=self.policy.k_max > 0)  # forced tokens; `none` stays plain decoding
        draft, proposed = plan_step(drafter, self.policy, grammar.views, grammar.room)
        draft = grammar.extend(draft)  # forced chain + draft, cut where the grammar forbids (trees: no grammar)
        ids, valid = verify_input([r.tokens[-1] for r in rows], draft.tokens, self.placeholder_id, self.device)
        tree = TreeInput.of(draft.parents, ids.shape[1], self.device) if draft.parents is not None else None
        # bias and penalties at each position from the tokens before it, then the grammar's mask
        with capture_hidden(
            self.target, wants_hidden(drafter), hidden_layers(drafter)
        ) as hidden:  # [B, 1 + k, H] for a head drafter
            if tree is None:
                out = kv.forward(ids, valid)
            else:
                out = kv.forward_tree(ids, valid, kv.next_pos.unsqueeze(1) + tree.depth, tree.attend).logits
            logits = grammar.mask(shape_logits(out, rows, draft.tokens))  # [B, 1 + k, V]
        drafted = [len(d) for d in draft.tokens]  # verified tokens (a tree's nodes)
        if tree is None:
            chains = draft.tokens
            accepted, next_tokens = verify(rows, chains, draft.probs, logits, self.placeholder_id)
            positions: list[list[int]] = [list(range(a + 1)) for a in accepted]
        else:  # greedy rows only (planning.plan_step): the accepted path is a chain from here on
            positions, next_tokens = walk(draft.tokens, draft.parents, logits.argmax(dim=-1))  # type: ignore[arg-type]
            chains = [[d[i - 1] for i in p[1:]] for d, p in zip(draft.tokens, positions)]
            accepted = [len(c) for c in chains]
            logits = path_logits(logits, positions)
        logprobs = step_logprobs(rows, logits, chains, accepted, next_tokens)
        drafter.feedback(grammar.views, grammar.drafted(draft.tokens), grammar.drafter_accepted(accepted))
        if hidden:  # only the accepted positions' states (the step's input token and accepted drafts) are valid
            drafter.observe_hidden(0, [hidden[-1][b, p] for b, p in enumerate(positions)])  # type: ignore[attr-defined]
        grammar.settle(accepted, next_tokens)
        if tree is None:
            kv.rollback(torch.tensor([n - a for n, a in zip(drafted, accepted)], device=self.device))
        else:
            kv.keep_last(path_keep(positions, ids.shape[1], self.device))
        kv.maybe_compact()

        events = []
        confidence = proposed.confidence or [None] * len(rows)
        failures = grammar.failures
        for b, (row, d, n, a, conf, nxt, f, lp) in enumerate(
            zip(rows, chains, drafted, accepted, confidence, next_tokens, map(len, grammar.forced), logprobs)
        ):
            if failures[b] is not None:  # its grammar engine gave up: the row ends with its output so far, alone
                row.stats.record_step(0, 0, 0)
                row.fail_grammar(failures[b])
                events.append(_Event(row, [], True))
                continue
            emitted = d[:a] + [nxt]
            row.stats.record_step(n - f, a - f, draft.forwards)  # the drafter's own tokens (after forced ones)
            if proposed.parents is None:
                observe_proposal(
                    self.policy, row.acceptance, proposed.tokens[b], conf, emitted[f:], a - f, drafter.free
                )
            else:  # a grown tree (no grammar, so nothing forced): every node is judged, verified or not
                observe_tree(self.policy, row.acceptance, proposed.tokens[b], proposed.parents[b], conf, emitted)
            before = row.stats.output_tokens
            new_ids = row.append(emitted, lp)
            row.stats.forced_tokens += min(f, row.stats.output_tokens - before)
            events.append(_Event(row, new_ids, row.finished))
        self.policy.observe_step(len(rows), drafted, time.perf_counter() - t0)
        return events
