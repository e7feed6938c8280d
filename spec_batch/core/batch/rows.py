"""One request in flight: its tokens, output text, statistics and acceptance, and how a step's tokens join it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..drafting.job_memory import JobMemory
from ..outputs import GRAMMAR_FAILED, FinishReason, GenerationResult, RequestStats, TokenLogprob
from ..params import SamplingParams
from ..policy import RowAcceptance
from ..structured.grammar import GrammarState
from ..text import OutputText


@dataclass
class Row:
    """A request in the batch. Satisfies the drafters' DraftRow and the verifier's VerifyRow."""

    index: int  # the request's position in generate()'s prompts
    prompt_len: int
    tokens: list[int]  # prompt + generated; the last is the next token the target reads
    params: SamplingParams
    seed: int
    text: OutputText
    acceptance: RowAcceptance
    stats: RequestStats
    started: float = field(default_factory=time.perf_counter)
    finish_reason: FinishReason | None = None
    out_len: int | None = None  # generated tokens kept in the output once finished (without an EOS)
    grammar: GrammarState | None = None  # the response_format's matcher, at the accepted output (grammar.py)
    logprobs: list[TokenLogprob] | None = None  # one per generated token (an EOS included) when params.logprobs
    error: str | None = None  # why it ended with finish_reason "error"
    memory: JobMemory | None = None  # its job's memory, which the drafter may draft from (None: an online request)
    plain: bool = False  # drafts nothing: the baseline's rows, decoded beside speculating ones

    @property
    def n_generated(self) -> int:
        """Output position of the next token to be produced (tokens generated so far, an EOS included)."""
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        end = self.prompt_len + (self.out_len if self.out_len is not None else self.n_generated)
        return self.tokens[self.prompt_len : end]

    def append(self, emitted: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> list[int]:
        """Adds a step's tokens (and their logprobs, when asked), stopping exactly at EOS, a stop string or
        max_new_tokens. Returns the output tokens added (an EOS is counted in stats.output_tokens but is not part
        of the output)."""
        before = self.n_generated
        for j, token in enumerate(emitted):
            self.tokens.append(token)
            if logprobs is not None:
                self.logprobs = self.logprobs if self.logprobs is not None else []
                self.logprobs.append(logprobs[j])
            self.stats.output_tokens += 1
            if self.text.add(token):
                self.finish("stop")
                break
            if self.n_generated >= self.params.max_new_tokens:
                self.finish("length")
                break
        return self.output_ids[before:]

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.out_len = self.n_generated - (1 if self.text.ended_by_eos else 0)
        self.text.close()
        self.stats.wall_s = time.perf_counter() - self.started

    def fail_grammar(self, why: str) -> None:
        """Ends the row with its output so far: its grammar engine gave up (core/structured/grammar.py)."""
        self.error = why
        self.finish("error")

    def output_logprobs(self, start: int = 0) -> list[TokenLogprob] | None:
        """The logprobs of output_ids[start:] (None unless params.logprobs)."""
        if not self.params.logprobs:
            return None
        return (self.logprobs or [])[start : len(self.output_ids)]

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None, f"request {self.index} is still in flight"
        failed = self.error is not None
        return GenerationResult(
            self.text.text,
            self.output_ids,
            self.finish_reason,
            self.stats,
            error=self.error,
            logprobs=self.output_logprobs(),
            error_code=GRAMMAR_FAILED if failed else None,
            error_param="response_format" if failed else None,
        )


def matched_run(proposal: Sequence[int], emitted: Sequence[int]) -> int:
    """How many leading proposed tokens equal what the step emitted."""
    run = 0
    while run < min(len(proposal), len(emitted)) and proposal[run] == emitted[run]:
        run += 1
    return run


def fill_order(stay: Sequence[int]) -> list[int]:
    """The batch positions that stay (ascending) as the new order: a row keeps its place, and each
    place a leaving row frees is taken by a staying row from beyond the new batch size. A row's output does not
    depend on its place, and the caches then copy only the moved rows (none where the last rows leave), where a
    kept order would shift every row below a leaving one."""
    n, kept = len(stay), set(stay)
    order = list(range(n))
    holes = [b for b in range(n) if b not in kept]
    movers = [b for b in stay if b >= n]
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order
