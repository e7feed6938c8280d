"""A job's measured speedup: its baseline sample decoded with and without speculation, in interleaved rounds.

The sample (a few of the job's valid requests, spread over the file) is claimed like any request
(jobs.claims), warmed up untimed with both decoders (each round's slice, its first tokens), then measured in ROUNDS alternating rounds: each round
decodes one slice of the sample with the job's decoder and with ``decoder.without_speculation()`` (same engine,
same requests), the order swapping every round (speculative first, then plain first, ...). A load that changes
while the sample is measured then hits both sides alike instead of one phase, and shows as a spread of the rounds'
ratios: the lowest and highest are stored beside the pooled speedup (``speedup_low``, ``speedup_high``), and the
speedup counts as unreliable when their spread exceeds UNRELIABLE_SPREAD of it (job_summary's speedup_reliable).

Cost: the rounds split the sample instead of repeating it, so the measurement decodes what a single before/after
measurement did (each sampled request once with and once without speculation); only a sample smaller than ROUNDS
decodes a request more than once. The speculative results are the requests' results (stored, not decoded again).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.decoder_like import DecoderLike
from ..core.outputs import RequestStats
from ..store import queries
from ..store.baselines import SamplePair, record_baseline_samples
from .claims import ClaimedRequests, claimed_requests
from .lease import Lease
from .runner import OnStored, held_lease

WARMUP_TOKENS = 16  # per sampled request, decoded untimed by both decoders before the rounds are timed
ROUNDS = 3  # interleaved rounds (at least 3: a range needs more than two points to say anything)
UNRELIABLE_SPREAD = 0.25  # (high - low) / speedup above this: the speedup is unreliable (the view says so too)


def speedup_is_reliable(speedup: float | None, low: float | None, high: float | None) -> bool | None:
    """False when the rounds' ratios spread over more than UNRELIABLE_SPREAD of the speedup; None when unknown."""
    if speedup is None or low is None or high is None:
        return None
    return (high - low) <= UNRELIABLE_SPREAD * speedup


def describe_speedup(speedup: float | None, low: float | None, high: float | None, reliable: bool | None) -> str:
    """The speedup in words, with its rounds' range and, when it is unreliable, why ("—" when not measured)."""
    if speedup is None:
        return "—"
    text = f"{speedup:.2f}x"
    if low is None or high is None:
        return text
    text += f" (rounds {low:.2f}x-{high:.2f}x)"
    if reliable is False:
        text += (
            f": unreliable, the rounds differ by more than {UNRELIABLE_SPREAD:.0%} of it "
            f"(the machine's load changed while it was measured)"
        )
    return text


@dataclass
class Round:
    """One interleaved round: the same requests decoded with (spec) and without (base) speculation."""

    spec_tokens: int = 0
    spec_wall_s: float = 0.0
    base_tokens: int = 0
    base_wall_s: float = 0.0

    @property
    def ratio(self) -> float | None:
        if not (self.spec_wall_s and self.base_wall_s and self.base_tokens):
            return None
        return (self.spec_tokens / self.spec_wall_s) / (self.base_tokens / self.base_wall_s)


@dataclass
class Baseline:
    n_requests: int
    baseline_output_tokens: int
    baseline_wall_s: float
    sample_output_tokens: int
    sample_wall_s: float
    stored: int = 0  # speculative sample results stored as the requests' results
    rounds: list[Round] = field(default_factory=list)

    @property
    def baseline_tokens_per_s(self) -> float | None:
        return RequestStats(output_tokens=self.baseline_output_tokens, wall_s=self.baseline_wall_s).tokens_per_s

    @property
    def sample_tokens_per_s(self) -> float | None:
        return RequestStats(output_tokens=self.sample_output_tokens, wall_s=self.sample_wall_s).tokens_per_s

    @property
    def speedup(self) -> float | None:
        a, b = self.sample_tokens_per_s, self.baseline_tokens_per_s
        return a / b if a is not None and b else None

    @property
    def speedup_low(self) -> float | None:
        ratios = [r.ratio for r in self.rounds if r.ratio is not None]
        return min(ratios) if ratios else None

    @property
    def speedup_high(self) -> float | None:
        ratios = [r.ratio for r in self.rounds if r.ratio is not None]
        return max(ratios) if ratios else None

    @property
    def reliable(self) -> bool | None:
        return speedup_is_reliable(self.speedup, self.speedup_low, self.speedup_high)


def choose_sample(ids: Sequence[int], k: int) -> list[int]:
    """k ids spread evenly over `ids` (all of them when k >= len(ids)); deterministic."""
    n = len(ids)
    if k >= n:
        return list(ids)
    return [ids[(i * n) // k] for i in range(k)]


def round_slices(n: int, rounds: int = ROUNDS) -> list[list[int]]:
    """The sample's positions decoded in each round: `rounds` interleaved slices of range(n) (every position in
    exactly one), or, for a sample smaller than `rounds`, its positions in turn (a position may repeat)."""
    if n <= 0:
        return []
    if n < rounds:
        return [[r % n] for r in range(rounds)]
    return [list(range(r, n, rounds)) for r in range(rounds)]


def measure_baseline(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: DecoderLike,
    *,
    sample_size: int | None = None,
    lease: Lease | None = None,
    worker: str | None = None,
    lease_seconds: float | None = None,
    on_stored: OnStored | None = None,
) -> Baseline | None:
    """Measures the job's speedup on a sample of its valid requests (see the module docstring) and stores it on
    the job (first measurement wins) with the rounds' range and each sampled request's pair (baseline_samples).
    The speculative results are stored as the sample requests' results (conditionally: nothing is stored twice;
    on_stored(status, stats) follows each one stored), so the sample is not decoded again.

    The sample is claimed under `lease` like any request (a live holder's requests are not sampled), which the
    caller's heartbeat renews (run_job's, a worker's); without one, this call makes its own. A sampled request
    whose prompt cannot be built is left to the runner (which fails it). Returns None when the sample size is 0,
    the job already has a baseline, or nothing of the sample could be claimed.
    """
    with session_factory() as s:
        job = queries.get_job(s, job_id)
        k = job.baseline_sample if sample_size is None else sample_size
        if k <= 0 or job.baseline_wall_s is not None:
            return None
        batch_size = job.batch_size
        sample = choose_sample(queries.valid_request_ids(s, job_id), k)
    with held_lease(session_factory, lease, worker, lease_seconds) as held:
        with claimed_requests(session_factory, job_id, sample, decoder, held, plain_only=True) as batch:
            if not batch.ids:
                return None
            return _measure(batch, decoder, batch_size, on_stored)


def _warm_up(batch: ClaimedRequests, decoders: Sequence[Any], slices: list[list[int]], batch_size: int) -> None:
    """Untimed, for both decoders: each round's slice, its first WARMUP_TOKENS tokens, so the timed rounds meet
    shapes already seen. First calls pay one-time costs for every shape they meet (a batch-8 verify step's among
    them), and a job's speculative decoder starts with a cold draft policy (a plain step first, step costs
    and confidence calibration unknown) that the rest of the job runs with once learned: timed cold, the speedup
    would measure that start rather than the job (docs/jobs.md, "Measured speedup")."""
    for positions in slices:
        prompts = [batch.prompts[i] for i in positions]
        warm = [
            replace(batch.params[i], max_new_tokens=min(batch.params[i].max_new_tokens, WARMUP_TOKENS))
            for i in positions
        ]
        for d in decoders:
            d.generate(prompts, warm, batch_size=batch_size, return_errors=True)


def _timed(
    decoder: DecoderLike, batch: ClaimedRequests, positions: list[int], batch_size: int
) -> tuple[list[Any], float]:
    prompts = [batch.prompts[i] for i in positions]
    params = [batch.params[i] for i in positions]
    t0 = time.perf_counter()
    results = decoder.generate(prompts, params, batch_size=batch_size, return_errors=True)
    return results, time.perf_counter() - t0


def _tokens(results: list[Any]) -> int:
    return sum(r.stats.output_tokens for r in results if r.finish_reason != "error")


def _measure(batch: ClaimedRequests, decoder: DecoderLike, batch_size: int, on_stored: OnStored | None) -> Baseline:
    base_decoder = decoder.without_speculation()
    slices = round_slices(len(batch.ids))
    _warm_up(batch, (decoder, base_decoder), slices, batch_size)
    b = Baseline(len(batch.ids), 0, 0.0, 0, 0.0)
    first: dict[int, tuple[Any, Any, float]] = {}  # position -> (spec result, base result, spec decode share)
    for r, positions in enumerate(slices):
        order = ("spec", "base") if r % 2 == 0 else ("base", "spec")
        out: dict[str, tuple[list[Any], float]] = {}
        for side in order:
            out[side] = _timed(decoder if side == "spec" else base_decoder, batch, positions, batch_size)
        (spec, spec_wall), (base, base_wall) = out["spec"], out["base"]
        b.rounds.append(Round(_tokens(spec), spec_wall, _tokens(base), base_wall))
        for pos, sr, br in zip(positions, spec, base):
            first.setdefault(pos, (sr, br, spec_wall / len(positions)))
    b.sample_output_tokens = sum(x.spec_tokens for x in b.rounds)
    b.sample_wall_s = sum(x.spec_wall_s for x in b.rounds)
    b.baseline_output_tokens = sum(x.base_tokens for x in b.rounds)
    b.baseline_wall_s = sum(x.base_wall_s for x in b.rounds)
    _record(batch, b, first)
    for pos, (sr, _, share) in sorted(first.items()):  # the results, with the decode time that produced them
        if batch.store(batch.ids[pos], sr, share):
            b.stored += 1
            if on_stored is not None:  # after the commit: only what SQL has
                on_stored(queries.result_status(sr), sr.stats)
    return b


def _record(batch: ClaimedRequests, b: Baseline, first: dict[int, tuple[Any, Any, float]]) -> None:
    with batch.session_factory.begin() as s:
        recorded = queries.record_baseline(
            s,
            batch.job_id,
            n_requests=b.n_requests,
            baseline_output_tokens=b.baseline_output_tokens,
            baseline_wall_s=b.baseline_wall_s,
            sample_output_tokens=b.sample_output_tokens,
            sample_wall_s=b.sample_wall_s,
            speedup_low=b.speedup_low,
            speedup_high=b.speedup_high,
        )
        if recorded:  # each request's pair, for reports (both decodes must have succeeded)
            record_baseline_samples(
                s,
                batch.job_id,
                [
                    SamplePair(
                        batch.ids[pos],
                        sr.stats.output_tokens,
                        sr.stats.target_forwards,
                        sr.stats.wall_s,
                        br.stats.output_tokens,
                        br.stats.wall_s,
                    )
                    for pos, (sr, br, _) in sorted(first.items())
                    if sr.finish_reason != "error" and br.finish_reason != "error"
                ],
            )


__all__ = [
    "ROUNDS",
    "UNRELIABLE_SPREAD",
    "WARMUP_TOKENS",
    "Baseline",
    "Round",
    "choose_sample",
    "describe_speedup",
    "measure_baseline",
    "round_slices",
    "speedup_is_reliable",
]
