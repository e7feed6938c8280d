"""The decoder: a target model, its tokenizer, a drafter factory and the draft policy, and the loop of one
`generate` call over a running batch (core/batch/running_batch.py: prefill, draft, one target forward over all drafts,
verify, roll back, stop).

Rows join the batch as others finish (continuous batching) and leave when done; each row has its own accepted
length every step, and nothing a row does changes another row's tokens.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import ChatTemplateError, InvalidParameterError, PromptError, PromptTooLongError
from .batch.grammar_step import row_grammar
from .batch.running_batch import RowUpdate, RunningBatch, Sink, end_row
from .drafting.drafter_registry import DRAFTERS
from .drafting.drafters import Drafter, NoDrafter
from .drafting.job_memory import JobMemory
from .inputs import PreparedRequest, Prompt, params_list, prompt_ids
from .kv.kv_batch import supports_model
from .kv.padding import skips_padding
from .outputs import GenerationResult, RequestStats, StreamChunk
from .params import SamplingParams
from .policy import DraftPolicy
from .step_costs import WALL_CLOCK, StepClock
from .text import eos_ids
from .thread_governor import ThreadGovernor

Request = PreparedRequest  # the name engine.py and callers import


class Results:
    """generate()'s results in prompt order; `finish` stores one and tells on_result."""

    def __init__(self, n: int, on_result: Callable[[int, GenerationResult], None] | None):
        self._results: list[GenerationResult | None] = [None] * n
        self._on_result = on_result

    def finish(self, index: int, result: GenerationResult) -> None:
        self._results[index] = result
        if self._on_result is not None:
            self._on_result(index, result)

    def sink(self, index: int) -> Sink:
        """The sink of prompt index's row: its result, once it has one."""

        def take(update: RowUpdate) -> None:
            if update.result is not None:
                self.finish(index, update.result)

        return take

    @property
    def values(self) -> list[GenerationResult]:
        return self._results  # type: ignore[return-value]


class Decoder:
    """A target model, its tokenizer and a drafter. Thread-safe: one decode step at a time per decoder.

    Build it with `load_decoder`. Attributes: tokenizer, target (HF model), target_name, draft_name,
    device, max_context (longest prompt + max_new_tokens the models accept), policy, uses_memory (its drafter drafts
    from a job memory: only then is one worth keeping), precision (what load_decoder loaded: the effective
    weights and dtypes of target and draft; None when built otherwise), clock (what a step costs, as the policy learns it: the wall
    clock unless given chosen costs), threads (the ThreadGovernor that sets a step's CPU threads from what other
    processes leave free, or None: torch's count as it is).
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
        uses_memory: bool = False,
        clock: StepClock = WALL_CLOCK,
        precision: Any = None,
        latency_slack: float | None = None,
        threads: ThreadGovernor | None = None,
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
        self.uses_memory = uses_memory
        self.precision = precision  # the effective weights and dtypes it runs at (loading's DecoderPrecision) or None
        self.clock = clock  # what each step is recorded to cost (the policy learns from it; tests choose it)
        self.threads = threads  # ticked before each step, on the thread that runs it
        self._drafter_factory = drafter_factory
        self._settings = {
            "num_draft_tokens": num_draft_tokens,
            "adaptive": adaptive,
            "tree_width": tree_width,
            "latency_slack": latency_slack,
        }
        self.policy = DraftPolicy(
            k_max=num_draft_tokens if DRAFTERS.drafts(draft_name) else 0,
            adaptive=adaptive,
            ragged=skips_padding(target),
            tree_width=tree_width,
            latency_slack=latency_slack,
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
        that use it (suffix, hybrid) draft from the other requests' outputs too. It changes drafts, never outputs.
        """
        results = Results(len(prompts), on_result)
        requests = self.prepare_many(prompts, params, batch_size, return_errors, results.finish)
        waiting = deque(requests)
        with self.exclusive():
            batch: RunningBatch[Sink] = RunningBatch(self)
            while waiting or batch:
                if should_stop is not None and should_stop():
                    batch.end(range(len(batch)))
                    for request in waiting:
                        end_row(batch.new_row(request), results.sink(request.index), "cancelled")
                    break
                if waiting and len(batch) < batch_size:
                    joining = [waiting.popleft() for _ in range(min(batch_size - len(batch), len(waiting)))]
                    batch.admit([batch.new_row(r, memory) for r in joining], [results.sink(r.index) for r in joining])
                batch.step()
        return results.values

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """One chunk per step with the tokens accepted in that step; the last carries finish_reason and stats.

        The decoder is locked per step, not for the whole stream, so an abandoned stream blocks nobody.
        """
        request = self.prepare(prompt, params or SamplingParams())
        updates: list[RowUpdate] = []
        batch: RunningBatch[Sink] | None = None
        while True:
            with self.exclusive():
                if batch is None:
                    batch = RunningBatch(self)
                    batch.admit([batch.new_row(request)], [updates.append])
                batch.step()
            for update in updates:
                yield update.chunk
                if update.result is not None:
                    return
            updates.clear()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the target's chat template applied to messages, with the generation prompt."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.target_name!r} was built without a chat template; pass prompts as text or ids"
            )
        return self.chat_template(messages)

    @property
    def drafter_factory(self) -> Callable[[], Drafter]:
        """What makes the drafter of each running batch."""
        return self._drafter_factory

    def with_drafter(self, drafter_factory: Callable[[], Drafter], draft_name: str | None = None) -> Decoder:
        """The same target, tokenizer and settings drafting with another drafter (a policy of its own): a drafter
        that knows the answers for a bench's ceiling, one that a test watches."""
        return Decoder(
            self.target,
            self.tokenizer,
            target_name=self.target_name,
            drafter_factory=drafter_factory,
            draft_name=draft_name or self.draft_name,
            device=self.device,
            max_context=self.max_context,
            chat_template=self.chat_template,
            uses_memory=self.uses_memory,
            clock=self.clock,
            **self._settings,
        )

    def without_speculation(self) -> Decoder:
        """The same engine and target with the `none` drafter: the baseline speedups are measured against."""
        return Decoder(
            self.target,
            self.tokenizer,
            target_name=self.target_name,
            drafter_factory=NoDrafter,
            draft_name=NoDrafter.name,
            device=self.device,
            max_context=self.max_context,
            num_draft_tokens=0,
            chat_template=self.chat_template,
            clock=self.clock,
            threads=self.threads,
        )

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held around each step of a running batch over this decoder (its policy and target are shared)."""
        with self._lock, torch.inference_mode():
            yield

    # ---------------------------------------------------------------- requests

    def prepare_many(
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
                requests.append(self.prepare(prompt, p, i))
            except (PromptTooLongError, InvalidParameterError) as exc:
                if not return_errors:
                    raise
                named = exc.with_traceback(None) if isinstance(exc, PromptError) else None  # kept without frames
                finish(i, GenerationResult("", [], "error", RequestStats(), error=str(exc), prompt_error=named))
        return requests

    def prepare(self, prompt: Prompt, params: SamplingParams, index: int = 0) -> Request:
        """Checks a prompt and builds its matcher now, so a bad prompt or grammar fails before decoding
        (PromptTooLongError, InvalidParameterError); index names the prompt in errors."""
        ids = prompt_ids(
            prompt,
            params,
            index,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            model_name=self.target_name,
        )
        return PreparedRequest(index, ids, params, row_grammar(self.tokenizer, self.eos_ids, params))
