"""Claim and decode: the one way a process takes some of a job's requests, turns them into the decoder's inputs,
stores what it decoded, and gives back what it did not. The runner (every request) and the baseline
measurement (the sample) both go through :func:`claimed_requests`.

Giving back, and the request's ``attempts``: a request's ``attempts`` counts the claims that ended without a
result because the process crashed or lost its lease (docs/jobs.md). A clean interruption (Ctrl-C: a
KeyboardInterrupt; the caller's stop; a cancelled job) gives the claims back without counting; an error that
escapes the decoder (a crash of this attempt, a worker's soft time limit) gives them back and counts one.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.params import SamplingParams
from ..errors import ChatTemplateError, SpecBatchError
from ..store import queries, request_claims
from .lease import Lease

# Interruptions that are not failures: the claims go back without counting an attempt.
CLEAN_INTERRUPTIONS: tuple[type[BaseException], ...] = (KeyboardInterrupt, GeneratorExit)


def build_prompt(decoder: Any, endpoint: str, prompt: Any) -> str | list[int]:
    """The decoder's input for a stored request: chat messages through the target's chat template."""
    if endpoint == "/v1/chat/completions":
        return decoder.apply_chat_template(prompt)
    return prompt


def prompt_error_code(exc: BaseException) -> str:
    if isinstance(exc, ChatTemplateError):
        return "chat_template_error"
    if isinstance(exc, SpecBatchError):
        return "invalid_request"
    return "internal_error"


@dataclass
class ClaimedRequests:
    """Requests claimed under one lease. `ids[i]` is decoded from `prompts[i]` with `params[i]`; `bad` are claimed
    requests whose prompt or parameters could not be built (the runner fails them; the baseline skips them)."""

    session_factory: sessionmaker[Session]
    job_id: str
    lease: Lease
    asked: int
    claimed: list[int]
    inputs: dict[int, queries.RequestInput]
    ids: list[int] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    bad: list[tuple[int, Exception]] = field(default_factory=list)
    unfinished: set[int] = field(default_factory=set)

    def store(self, request_id: int, result: Any, decode_s: float = 0.0) -> bool:
        """Stores a GenerationResult (if the request is still open) and the decode time that produced it, in one
        transaction. True when stored."""
        with self.session_factory.begin() as s:
            stored = queries.save_result(s, request_id, result, worker=self.lease.token)
            if stored:
                queries.add_decode_time(s, self.job_id, decode_s)
        self.unfinished.discard(request_id)
        return stored

    def fail(self, request_id: int, exc: Exception) -> bool:
        """Stores the request as failed without a result (its prompt could not be built). True when stored."""
        with self.session_factory.begin() as s:
            stored = queries.save_failure(s, request_id, prompt_error_code(exc), str(exc), worker=self.lease.token)
        self.unfinished.discard(request_id)
        return stored


def _build_inputs(batch: ClaimedRequests, decoder: Any) -> None:
    for rid in batch.claimed:
        row = batch.inputs[rid]
        try:
            prompt = build_prompt(decoder, row.endpoint, row.prompt)
            params = SamplingParams.from_dict(row.params)
        except Exception as e:  # this request alone: the others go on
            batch.bad.append((rid, e))
            continue
        batch.ids.append(rid)
        batch.prompts.append(prompt)
        batch.params.append(params)


@contextmanager
def claimed_requests(
    session_factory: sessionmaker[Session], job_id: str, ids: Sequence[int], decoder: Any, lease: Lease,
) -> Iterator[ClaimedRequests]:
    """Claims the claimable ones of `ids` under `lease` and builds their decoder inputs; at the end of the block,
    every claimed request not stored goes back to pending: without counting an attempt after a clean end or
    interruption, counting one when an error escapes the block (see the module docstring)."""
    with session_factory.begin() as s:
        claimed = request_claims.claim_requests(s, job_id, ids, worker=lease.token, lease_seconds=lease.seconds)
        inputs = queries.request_inputs(s, claimed)
    batch = ClaimedRequests(session_factory, job_id, lease, len(ids), claimed, inputs, unfinished=set(claimed))
    crashed = False
    try:
        _build_inputs(batch, decoder)
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
    "build_prompt",
    "claimed_requests",
    "prompt_error_code",
]
