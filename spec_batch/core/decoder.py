"""The speculative decoding loop: prefill, draft, one target forward over all drafts, verify, roll back, stop.

Rows join the batch as others finish (continuous batching) and leave when done; each row has its own
accepted length every step, and nothing a row does changes another row's tokens.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter, NoDrafter
from ..errors import ChatTemplateError, InvalidParameterError, PromptTooLongError
from .kv_batch import KVBatch, supports_model
from .outputs import GenerationResult, RequestStats, StreamChunk
from .policy import DepthSurvival, DraftPolicy, RowAcceptance
from .sampling import (
    STREAM_TARGET,
    SamplingParams,
    accept_uniform,
    exponential_noise,
    fresh_seed,
    logits_to_probs,
)
from .verify import accept_matching, accept_rejection_sampling

Prompt = str | list[int]


@dataclass
class _Row:
    """One request in flight."""

    index: int
    prompt_len: int
    tokens: list[int]  # prompt + generated; the last is the next token the target reads
    params: SamplingParams
    seed: int
    stats: RequestStats
    started: float
    acceptance: RowAcceptance = field(default_factory=RowAcceptance)
    finish_reason: str | None = None
    out_len: int | None = None  # generated tokens kept in the output (EOS and stop cuts applied)
    text: str = ""  # the output text so far (final once finished)
    streamed_chars: int = 0

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        end = self.prompt_len + (self.out_len if self.out_len is not None else self.n_generated)
        return self.tokens[self.prompt_len : end]


@dataclass
class _Event:
    row: _Row
    new_ids: list[int]  # output tokens this step added (after cuts)
    finished: bool


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
        self._free_drafter = draft_name == "ngram"
        self.policy = DraftPolicy(k_max=num_draft_tokens if draft_name != "none" else 0, adaptive=adaptive)
        self.survival = DepthSurvival(depth=max(1, num_draft_tokens) + 1)  # learned across calls: the workload's
        if self._free_drafter:
            self.policy.probe_every = 0  # its proposals are checked against every step anyway: no probing needed
        self._lock = threading.Lock()
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.eos_ids = _eos_ids(target, tokenizer)
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
    ) -> list[GenerationResult]:
        """Decodes every prompt (str used as given, no chat template; or token ids).

        params: one SamplingParams for all prompts, or one per prompt. return_errors=False: a bad prompt
        raises before anything is decoded; True: that prompt alone gets finish_reason="error" with .error.
        on_result(index, result) is called as each request finishes.
        """
        if isinstance(prompts, (str, bytes)):
            raise InvalidParameterError("prompts must be a list of prompts; wrap a single prompt in a list")
        if batch_size < 1:
            raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}")
        plist = self._params_list(params, len(prompts))
        results: list[GenerationResult | None] = [None] * len(prompts)

        def finish(i: int, res: GenerationResult) -> None:
            results[i] = res
            if on_result is not None:
                on_result(i, res)

        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                requests.append((i, self._prompt_ids(prompt, p, i), p))
            except (PromptTooLongError, InvalidParameterError) as exc:
                if not return_errors:
                    raise
                finish(i, GenerationResult("", [], "error", RequestStats(), error=str(exc)))
        with self._lock, torch.inference_mode():
            for event in self._run(requests, batch_size):
                if event.finished:
                    finish(event.row.index, self._result(event.row))
        return results  # type: ignore[return-value]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """One chunk per step with the tokens accepted in that step; the last carries finish_reason and stats.

        The decoder is locked per step, not for the whole stream, so an abandoned stream blocks nobody.
        """
        p = params or SamplingParams()
        ids = self._prompt_ids(prompt, p, 0)
        events = self._run([(0, ids, p)], 1)
        while True:
            with self._lock, torch.inference_mode():
                event = next(events, None)
            if event is None:
                return
            row = event.row
            text = self._stream_text(row, event.finished)
            if event.finished:
                yield StreamChunk(text, event.new_ids, row.finish_reason, row.stats)  # type: ignore[arg-type]
            elif text or event.new_ids:
                yield StreamChunk(text, event.new_ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the target's chat template applied to messages, with the generation prompt."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.target_name!r} was built without a chat template; pass prompts as text or ids")
        return self.chat_template(messages)

    def without_speculation(self) -> "Decoder":
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

    # ---------------------------------------------------------------- inputs and outputs

    def _params_list(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        plist = list(params)
        if len(plist) != n:
            raise InvalidParameterError(f"got {len(plist)} SamplingParams for {n} prompts")
        return plist

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams, index: int) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidParameterError(f"prompt {index}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        else:
            raise InvalidParameterError(f"prompt {index}: expected a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidParameterError(f"prompt {index} is empty")
        if len(ids) + params.max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt {index} has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                f"{len(ids) + params.max_new_tokens} positions but {self.target_name!r} has a context of "
                f"{self.max_context}: shorten the prompt or lower max_new_tokens"
            )
        return ids

    def _result(self, row: _Row) -> GenerationResult:
        return GenerationResult(row.text, row.output_ids, row.finish_reason, row.stats)  # type: ignore[arg-type]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stream_text(self, row: _Row, finished: bool) -> str:
        """New text since the last chunk; holds back what could still become a stop string or a split character."""
        text = row.text
        safe = len(text)
        if not finished:
            longest_stop = max((len(s) for s in row.params.stop), default=0)
            safe = max(row.streamed_chars, len(text) - max(0, longest_stop - 1))
            while safe > row.streamed_chars and text[safe - 1] == "\ufffd":
                safe -= 1
        chunk = text[row.streamed_chars : safe]
        row.streamed_chars = max(row.streamed_chars, safe)
        return chunk

    # ---------------------------------------------------------------- the loop

    def _run(self, requests: list[tuple[int, list[int], SamplingParams]], batch_size: int) -> Iterator[_Event]:
        waiting = deque(requests)
        active: list[_Row] = []
        kv = KVBatch(self.target, self.device, 0)
        drafter = self._drafter_factory()
        while waiting or active:
            if waiting and len(active) < batch_size:
                group = [self._new_row(*waiting.popleft()) for _ in range(min(batch_size - len(active), len(waiting)))]
                self._prefill(kv, group)
                drafter.admit(group)
                active.extend(group)
            events = self._step(kv, drafter, active)
            yield from events
            if any(e.finished for e in events):
                keep = [b for b, e in enumerate(events) if not e.finished]
                active = [active[b] for b in keep]
                if active:
                    kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
                    drafter.keep_rows(keep)
                else:
                    kv = KVBatch(self.target, self.device, 0)
                    drafter = self._drafter_factory()

    def _new_row(self, index: int, ids: list[int], params: SamplingParams) -> _Row:
        seed = params.seed if params.seed is not None else fresh_seed()
        stats = RequestStats(prompt_tokens=len(ids))
        row = _Row(index, len(ids), list(ids), params, seed, stats, time.perf_counter())
        if self._free_drafter:
            # a drafter that costs nothing is checked against every step's output anyway, so a new row starts
            # skeptical and earns long drafts by matching (free-form text then never pays for a wide verify)
            row.acceptance = RowAcceptance(first_hits=0.2, first_tries=2.0)
        return row

    def _prefill(self, kv: KVBatch, rows: list[_Row]) -> None:
        """Caches every prompt token but the last, which the first step reads together with the first draft."""
        group = KVBatch(self.target, self.device, len(rows))
        ids, valid = self._left_padded([row.tokens[:-1] for row in rows])
        group.forward(ids, valid, logits_to_keep=1)
        kv.extend(group)

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max(len(s) for s in seqs))
        ids = torch.full((len(seqs), width), self.placeholder_id, dtype=torch.long)
        valid = torch.zeros((len(seqs), width), dtype=torch.bool)
        for b, s in enumerate(seqs):
            if s:
                ids[b, width - len(s) :] = torch.tensor(s, dtype=torch.long)
                valid[b, width - len(s) :] = True
        return ids.to(self.device), valid.to(self.device)

    def _step(self, kv: KVBatch, drafter: Drafter, rows: list[_Row]) -> list[_Event]:
        t0 = time.perf_counter()
        batch = len(rows)
        # a step yields accepted + 1 tokens, so drafting more than the remaining budget - 1 is waste
        budget = [max(0, r.params.max_new_tokens - r.n_generated - 1) for r in rows]
        available = [min(a, b) for a, b in zip(drafter.available(rows, self.policy.k_max), budget)]
        k = self.policy.choose(
            batch, [r.acceptance.first for r in rows], available, self.survival.continuation(self.policy.k_max)
        )
        ks = [min(k, a) for a in available]
        if drafter.has_probs:
            # with a sampling draft model the sample at a position depends on whether a draft was verified there,
            # so a seeded sampled row drafts a length of its own (not the batch's adaptive k): same seed, same
            # output, whatever batch it is in
            ks = [a if (r.params.seed is not None and not r.params.greedy) else kb for r, a, kb in zip(rows, available, ks)]
        # drafters with no cost and no distribution also tell what they would have proposed (for acceptance stats)
        shadow = drafter.propose(rows, available) if not drafter.has_probs and any(available) else None
        if shadow is not None:
            draft = Draft(tokens=[t[:kb] for t, kb in zip(shadow.tokens, ks)])
        elif any(ks):
            draft = drafter.propose(rows, ks)
        else:
            draft = Draft(tokens=[[] for _ in rows])
        width = 1 + max(len(t) for t in draft.tokens)

        ids = torch.full((batch, width), self.placeholder_id, dtype=torch.long)
        valid = torch.zeros((batch, width), dtype=torch.bool)
        for b, row in enumerate(rows):
            d = draft.tokens[b]
            ids[b, 0] = row.tokens[-1]
            if d:
                ids[b, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.long)
            valid[b, : 1 + len(d)] = True
        logits = kv.forward(ids.to(self.device), valid.to(self.device))  # [B, width, V]
        accepted, next_tokens = self._verify(rows, draft, logits, width - 1)

        drafter.feedback(rows, [len(d) for d in draft.tokens], accepted)
        kv.rollback(torch.tensor([len(d) - a for d, a in zip(draft.tokens, accepted)], device=self.device))
        kv.maybe_compact()

        events = []
        for b, row in enumerate(rows):
            d, a = draft.tokens[b], accepted[b]
            emitted = d[:a] + [next_tokens[b]]
            st = row.stats
            st.target_forwards += 1
            st.draft_tokens += len(d)
            st.accepted_tokens += a
            if d:
                st.draft_forwards += draft.forwards
                st.record_step(a)
            if shadow is not None and shadow.tokens[b]:
                proposal = shadow.tokens[b]
                run = 0
                while run < min(len(proposal), len(emitted)) and proposal[run] == emitted[run]:
                    run += 1
                offered = min(len(proposal), len(emitted))  # beyond the emitted tokens nothing was checked
                row.acceptance.observe(run, rejected=run < offered)
                self.survival.observe(offered, run)
            elif d:
                row.acceptance.observe(a, rejected=a < len(d))
                self.survival.observe(len(d), a)
            events.append(self._append(row, emitted))
        self.policy.observe_step(batch, width, time.perf_counter() - t0)
        return events

    def _verify(self, rows: list[_Row], draft: Draft, logits: torch.Tensor, k: int) -> tuple[list[int], list[int]]:
        """Accepted length and the target's next token per row. logits [B, k + 1, V]."""
        batch = len(rows)
        draft_tokens = torch.tensor(
            [d + [self.placeholder_id] * (k - len(d)) for d in draft.tokens], dtype=torch.long, device=self.device
        ).view(batch, k)
        draft_len = torch.tensor([len(d) for d in draft.tokens], dtype=torch.long, device=self.device)
        target_tokens = logits.argmax(dim=-1)  # [B, k + 1]: greedy rows are done here
        sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
        rejection = [b for b in sampled if draft.probs is not None and draft.tokens[b]]
        one_hot = [b for b in sampled if b not in set(rejection)]
        if one_hot:
            idx = torch.tensor(one_hot, device=self.device)
            probs = self._probs([rows[b] for b in one_hot], logits[idx])
            noise = self._noise([rows[b] for b in one_hot], [len(draft.tokens[b]) + 1 for b in one_hot], k + 1)
            target_tokens[idx] = (probs / noise).argmax(dim=-1)
        accepted = accept_matching(draft_tokens, draft_len, target_tokens)
        next_tokens = target_tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
        if rejection:
            idx = torch.tensor(rejection, device=self.device)
            rrows = [rows[b] for b in rejection]
            target_probs = self._probs(rrows, logits[idx])  # [R, k + 1, V]
            draft_probs = draft.probs[idx][:, :k]  # [R, k, V]
            uniforms = torch.tensor(
                [[accept_uniform(r.seed, r.n_generated + j, self.device) for j in range(k)] for r in rrows],
                device=self.device,
            ).view(len(rrows), k)
            noise = self._noise(rrows, [len(draft.tokens[b]) + 1 for b in rejection], k + 1)
            acc_r, next_r = accept_rejection_sampling(
                draft_tokens[idx], draft_len[idx], draft_probs, target_probs, uniforms, noise
            )
            accepted[idx] = acc_r
            next_tokens[idx] = next_r
        return accepted.tolist(), next_tokens.tolist()

    def _probs(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=self.device)
        top_k = torch.tensor([r.params.top_k for r in rows], device=self.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=self.device)
        return logits_to_probs(logits, temps, top_k, top_p)

    def _noise(self, rows: list[_Row], needed: list[int], width: int) -> torch.Tensor:
        """Exp(1) noise [R, width, V] keyed by (seed, output position); ones where a position is not needed."""
        out = torch.ones((len(rows), width, self.vocab_size), device=self.device)
        for i, (row, n) in enumerate(zip(rows, needed)):
            for j in range(n):
                out[i, j] = exponential_noise(row.seed, row.n_generated + j, STREAM_TARGET, self.vocab_size, self.device)
        return out

    def _append(self, row: _Row, emitted: list[int]) -> _Event:
        """Adds a step's tokens to a row, stopping exactly at EOS, max_new_tokens or a stop string."""
        p = row.params
        before = row.n_generated
        for tok in emitted:
            row.tokens.append(tok)
            row.stats.output_tokens += 1
            if tok in self.eos_ids:
                row.finish_reason, row.out_len = "stop", row.n_generated - 1  # EOS is not part of the output
                break
            if row.n_generated >= p.max_new_tokens:
                row.finish_reason, row.out_len = "length", row.n_generated
                break
        ids = row.output_ids
        row.text = self._decode(ids)
        if p.stop:
            self._cut_at_stop(row, before)
        if row.finish_reason is not None:
            row.stats.wall_s = time.perf_counter() - row.started
        return _Event(row, row.output_ids[before:], row.finish_reason is not None)

    def _cut_at_stop(self, row: _Row, before: int) -> None:
        longest = max(len(s) for s in row.params.stop)
        previous = self._decode(row.tokens[row.prompt_len : row.prompt_len + before]) if before else ""
        start = max(0, len(previous) - longest + 1)
        hits = [(row.text.find(s, start), s) for s in row.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return
        pos, stop = min(hits)
        # keep the fewest tokens whose text contains the stop string
        ids = row.output_ids
        for n in range(before + 1, len(ids) + 1):
            if stop in self._decode(ids[:n])[start:]:
                break
        row.out_len = n
        row.stats.output_tokens = n  # tokens after the stop string were never part of the output
        row.text = row.text[:pos]
        row.finish_reason = "stop"


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids
