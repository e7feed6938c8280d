"""A request's choices: `n > 1` decodes the same prompt n times, and a request with logprobs keeps each token's
log-probability. The runner expands a row into its choices (`expand`), then `Choices.add` gathers the results of
one row and gives back, once all of them are in, the row's merged result and the records to store
(requests.choices; export renders them with spec_batch.openai_format.render).

Seeds: choice 0 keeps the request's seed (n=1 decodes exactly as before); choice i > 0 gets a seed derived from
(seed, i), so a seeded request gives the same n choices on every run. Without a seed every choice is fresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from ..core.outputs import GenerationResult, RequestStats
from ..core.params import SamplingParams
from ..openai_format.render import token_records

_SUMMED = (
    "output_tokens",
    "draft_tokens",
    "accepted_tokens",
    "target_forwards",
    "draft_forwards",
    "forced_tokens",
    "wall_s",
)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed` (choice 0: the seed itself)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: a valid seed everywhere


def expand(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of the n choices."""
    return [params] + [dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(1, n)]


def choices_of(prompts: list[Any], params: SamplingParams, n: int) -> list[tuple[Any, SamplingParams]]:
    """(prompt, params) of each choice of a request with several prompts: choice k * n + j is prompt k's choice j
    (OpenAI's order). Prompt k's choices are seeded as those of a request with prompt k alone."""
    return [(prompt, p) for prompt in prompts for p in expand(params, n)]


def n_of(options: dict[str, Any] | None) -> int:
    return int((options or {}).get("n", 1))


def _merged(results: list[GenerationResult], per_prompt: int) -> GenerationResult:
    """One row's result: choice 0's text and finish reason, the statistics of all choices (each prompt once: the
    choices of prompt k are results[k * per_prompt : (k + 1) * per_prompt])."""
    first = results[0]
    stats = RequestStats(**{f.name: getattr(first.stats, f.name) for f in dataclasses.fields(RequestStats)})
    for i, r in enumerate(results[1:], 1):
        for name in _SUMMED:
            setattr(stats, name, getattr(stats, name) + getattr(r.stats, name))
        if i % per_prompt == 0:
            stats.prompt_tokens += r.stats.prompt_tokens
    return dataclasses.replace(first, stats=stats)


class Choices:
    """Gathers the choices of the rows of one generate() call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.n: dict[int, int] = {}
        self.per_prompt: dict[int, int] = {}
        self.done: dict[int, dict[int, GenerationResult]] = {}

    def expect(self, rid: int, n: int, per_prompt: int | None = None) -> None:
        """Row `rid` has n choices in all; per_prompt: choices of each of its prompts (several prompts: a
        completion's list of prompts, choice index = prompt index * per_prompt + j); None: one prompt."""
        self.n[rid] = n
        self.per_prompt[rid] = per_prompt or n
        self.done[rid] = {}

    def add(self, rid: int, index: int, result: GenerationResult) -> tuple[GenerationResult, list | None] | None:
        """Choice `index` of row `rid` is in. When the row is complete: (merged result, choice records or None
        when the plain `output` column says it all); a failed choice fails the row. None while choices are due."""
        if result.finish_reason == "error":
            self.done.pop(rid, None)
            return result, None
        got = self.done.get(rid)
        if got is None:  # the row already failed
            return None
        got[index] = result
        if len(got) < self.n[rid]:
            return None
        results = [got[i] for i in range(self.n[rid])]
        del self.done[rid]
        with_logprobs = any(getattr(r, "logprobs", None) is not None for r in results)
        records = None
        if len(results) > 1 or with_logprobs:
            records = [
                {
                    "text": r.text,
                    "finish_reason": r.finish_reason,
                    "logprobs": token_records(self.tokenizer, getattr(r, "logprobs", None)),
                }
                for r in results
            ]
        return _merged(results, self.per_prompt.pop(rid, len(results))), records
