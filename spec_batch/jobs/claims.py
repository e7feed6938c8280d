"""Claim and decode: the one way a process takes some of a job's requests, turns them into the decoder's inputs,
stores what it decoded, and gives back what it did not. The runner (every request) and the baseline
measurement (the sample) both go through :func:`claimed_requests`.

Giving back, and the request's ``attempts``: a request's ``attempts`` counts the claims that ended without a
result because the process crashed or lost its lease (docs/jobs.md). A clean interruption (Ctrl-C: a
KeyboardInterrupt; the caller's stop, or a jobs.errors.RunStopped its code raises; a cancelled job) gives the
claims back without counting; an error that escapes the decoder (a crash of this attempt, a worker's soft time
limit) gives them back and counts one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.decoder_like import DecoderLike
from ..core.params import SamplingParams
from ..openai_format.prompts import build_prompt, prompt_error_code, prompt_list
from ..store import queries, request_claims
from .choices import Choices, choices_of, n_of
from .errors import RunStopped
from .lease import Lease

# Interruptions that are not failures: the claims go back without counting an attempt.
CLEAN_INTERRUPTIONS: tuple[type[BaseException], ...] = (KeyboardInterrupt, GeneratorExit, RunStopped)


@dataclass
class ClaimedRequests:
    """Requests claimed under one lease. `ids[i]` is decoded from `prompts[i]` with `params[i]` as its choice
    `choice_index[i]` (a request with n > 1 appears once per choice); `bad` are claimed requests whose prompt or
    parameters could not be built (the runner fails them; the baseline skips them)."""

    session_factory: sessionmaker[Session]
    job_id: str
    lease: Lease
    asked: int
    claimed: list[int]
    inputs: dict[int, queries.RequestInput]
    ids: list[int] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    choice_index: list[int] = field(default_factory=list)
    bad: list[tuple[int, Exception]] = field(default_factory=list)
    unfinished: set[int] = field(default_factory=set)
    choices: Choices = field(default_factory=lambda: Choices(None))

    def store(self, request_id: int, result: Any, decode_s: float = 0.0, records: list | None = None) -> bool:
        """Stores a GenerationResult (if the request is still open) and the decode time that produced it, in one
        transaction; `records`: the request's choices (requests.choices). True when stored."""
        with self.session_factory.begin() as s:
            stored = queries.save_result(s, request_id, result, worker=self.lease.token, choices=records)
            if stored:
                queries.add_decode_time(s, self.job_id, decode_s)
        self.unfinished.discard(request_id)
        return stored

    def store_prompt(self, i: int, result: Any, decode_s: float = 0.0) -> bool | None:
        """Stores the result of prompt i: with n > 1 the request is stored once all its choices are in (None until
        then, and for the choices of a request that already failed). True when stored."""
        complete = self.choices.add(self.ids[i], self.choice_index[i], result)
        if complete is None:
            return None
        merged, records = complete
        return self.store(self.ids[i], merged, decode_s, records)

    def fail(self, request_id: int, exc: Exception) -> bool:
        """Stores the request as failed without a result (its prompt could not be built). True when stored."""
        with self.session_factory.begin() as s:
            stored = queries.save_failure(s, request_id, prompt_error_code(exc), str(exc), worker=self.lease.token)
        self.unfinished.discard(request_id)
        return stored


def _build_inputs(batch: ClaimedRequests, decoder: DecoderLike, plain_only: bool) -> None:
    batch.choices = Choices(getattr(decoder, "tokenizer", None))
    for rid in batch.claimed:
        row = batch.inputs[rid]
        n = n_of(row.options)
        prompts = prompt_list(row.endpoint, row.prompt)
        if plain_only and (n > 1 or len(prompts) > 1 or (row.params or {}).get("logprobs")):
            continue  # its choices are the runner's to store (jobs/choices.py); given back unclaimed at the end
        try:
            built = [build_prompt(decoder, row.endpoint, p) for p in prompts]
            params = SamplingParams.from_dict(row.params)
        except Exception as e:  # this request alone: the others go on
            batch.bad.append((rid, e))
            continue
        batch.choices.expect(rid, len(built) * n, n)
        # n > 1: the same prompt once per choice; several prompts: each prompt's n choices in turn
        for index, (prompt, choice_params) in enumerate(choices_of(built, params, n)):
            batch.ids.append(rid)
            batch.choice_index.append(index)
            batch.prompts.append(prompt)
            batch.params.append(choice_params)


@contextmanager
def claimed_requests(
    session_factory: sessionmaker[Session],
    job_id: str,
    ids: Sequence[int],
    decoder: DecoderLike,
    lease: Lease,
    *,
    plain_only: bool = False,
) -> Iterator[ClaimedRequests]:
    """Claims the claimable ones of `ids` under `lease` and builds their decoder inputs; at the end of the block,
    every claimed request not stored goes back to pending: without counting an attempt after a clean end or
    interruption, counting one when an error escapes the block (see the module docstring). `plain_only`: leave out
    requests with n > 1 or logprobs (the baseline sample: one result per request)."""
    with session_factory.begin() as s:
        claimed = request_claims.claim_requests(s, job_id, ids, worker=lease.token, lease_seconds=lease.seconds)
        inputs = queries.request_inputs(s, claimed)
    batch = ClaimedRequests(session_factory, job_id, lease, len(ids), claimed, inputs, unfinished=set(claimed))
    crashed = False
    try:
        _build_inputs(batch, decoder, plain_only)
        yield batch
    except CLEAN_INTERRUPTIONS:
        raise
    except BaseException:
        crashed = True
        raise
    finally:
        if batch.unfinished:  # stopped, Ctrl-C or an error: give the rest back at once
            with session_factory.begin() as s:
                request_claims.release_requests(s, sorted(batch.unfinished), worker=lease.token, lost=crashed)


__all__ = [
    "CLEAN_INTERRUPTIONS",
    "ClaimedRequests",
    "claimed_requests",
]
