"""Replays a job's stored outputs through the drafters: what each would have given, before running it.

For every completed request of a job (in the order they completed), the prompt is rebuilt the way the runner
builds it and the stored output is re-tokenized; then, for each drafter, greedy decoding is simulated at batch 1:
a step offers a draft, accepts the prefix equal to the output, and yields it plus one token. No model forward
runs (the output is known), so a replay takes seconds:

  ngram                  prompt lookup (the n-gram drafter)
  suffix                 suffix drafting from the request's own prompt + output
  suffix + job memory    the same, plus a memory of the job's earlier outputs (what `spec-batch run` uses)

each under two policies: `fixed` drafts all that is offered (up to --k-max), `adaptive` is the decoder's policy
(per-row lengths from calibrated confidence and the cost of each verify width). Costs: --costs gives the seconds
(or any unit) of a step per verify width at batch 1, as measured on your machine (e.g. `1:0.031,2:0.032,4:0.034,
8:0.038,16:0.047`; widths in between are interpolated); without it a step of width w is assumed to cost
1 + 0.04 (w - 1) steps of width 1. The estimated speedup over `none` is tokens per step x cost(1) / mean step cost.

    python bench/bench_replay.py JOB_ID [--database-url URL] [--costs W:S,...] [--k-max 16] [--limit N]

Caveats: SQL keeps output text, so outputs are re-tokenized (a token boundary can differ from the original
ids); the simulation is batch 1 (at larger batches a step's width is the longest row's draft).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spec_batch.core.drafters import Drafter, NgramDrafter  # noqa: E402
from spec_batch.core.job_memory import JobMemory  # noqa: E402
from spec_batch.core.policy import DraftPolicy, PaddedCosts, RowAcceptance, StepCosts  # noqa: E402
from spec_batch.core.rows import matched_run  # noqa: E402
from spec_batch.core.params import SamplingParams  # noqa: E402
from spec_batch.core.suffix_drafter import SuffixDrafter  # noqa: E402

Request = tuple[list[int], list[int]]  # (prompt ids, output ids)


@dataclass
class _Row:
    tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    n_generated: int = 0


@dataclass
class ReplayStats:
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    cost: float = 0.0  # sum of the steps' costs

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    def speedup(self, cost1: float) -> float:
        """Tokens per unit of cost over plain decoding's (one token per step of cost(1))."""
        return (self.tokens / self.cost) * cost1 if self.cost else float("nan")


def step_costs(spec: str | None) -> StepCosts:
    costs = StepCosts()
    if spec:
        for item in spec.split(","):
            width, seconds = item.split(":")
            costs.seconds[(1, int(width))] = float(seconds)
    else:
        for width in (1, 2, 3, 5, 9, 17, 33):
            costs.seconds[(1, width)] = 1.0 + 0.04 * (width - 1)
    return costs


def replay(requests: list[Request], new_drafter: Callable[[], Drafter], costs: StepCosts, k_max: int,
           adaptive: bool, initial_acceptance: tuple[float, float]) -> ReplayStats:
    """Greedy decoding of known outputs at batch 1, request after request, with one policy for the whole job."""
    policy = DraftPolicy(k_max=k_max, adaptive=adaptive)
    policy.costs = PaddedCosts.fixed(costs)  # the measured (or assumed) costs, not this simulation's timings
    stats = ReplayStats()
    for prompt, output in requests:
        if not prompt or not output:
            continue
        drafter = new_drafter()
        row = _Row(tokens=list(prompt))
        acceptance = RowAcceptance(*initial_acceptance)
        drafter.admit([row])
        pos = 0
        while pos < len(output):
            budget = len(output) - pos - 1
            available = min(drafter.available([row], k_max)[0], budget)
            full = drafter.propose([row], [available])
            proposal = full.tokens[0][:available]
            confidence = full.confidence[0][:available] if full.confidence is not None else None
            k = policy.plan(1, [policy.accept_probs(acceptance, len(proposal), confidence)], probe=False)[0]
            draft = proposal[:k]
            accepted = matched_run(draft, output[pos:])
            emitted = output[pos : pos + accepted + 1]
            drafter.feedback([row], [k], [accepted])
            policy.observe_row(acceptance, confidence, matched_run(proposal, emitted), min(len(proposal), len(emitted)))
            stats.cost += costs.estimate(1, 1 + k) or 1.0
            stats.steps += 1
            stats.drafted += k
            stats.accepted += accepted
            stats.tokens += len(emitted)
            row.tokens += emitted
            row.n_generated += len(emitted)
            pos += len(emitted)
        drafter.keep_rows([])  # the row leaves: a job memory takes its whole output
    return stats


def drafters() -> dict[str, Callable[[], Callable[[], Drafter]]]:
    """name -> a maker of the per-replay drafter factory (a job memory is one per replay)."""
    def with_memory() -> Callable[[], Drafter]:
        memory = JobMemory()
        return lambda: SuffixDrafter(memory)

    return {
        "ngram": lambda: NgramDrafter,
        "suffix": lambda: SuffixDrafter,
        "suffix + job memory": with_memory,
    }


def load_requests(database_url: str, job_id: str, limit: int | None) -> tuple[str, list[Request]]:
    """The job's target and its completed requests as (prompt ids, output ids), in the order they completed."""
    from spec_batch import load_decoder
    from spec_batch.jobs.runner import build_prompt
    from spec_batch.store import make_session_factory, queries

    factory = make_session_factory(database_url)
    with factory() as s:
        job_id = queries.resolve_job_id(s, job_id)
        target = queries.get_job(s, job_id).target
        rows = [(r.completed_at, r.id, r.endpoint, r.prompt, r.output) for r in queries.iter_requests(s, job_id)
                if r.status == "completed" and r.output is not None]
    rows.sort(key=lambda r: (r[0], r[1]))
    rows = rows[:limit] if limit else rows
    decoder = load_decoder(target, "none")  # the tokenizer and chat template the runner used
    out = []
    for _, _, endpoint, prompt, output in rows:
        built = build_prompt(decoder, endpoint, prompt)
        ids = decoder.tokenizer.encode(built) if isinstance(built, str) else list(built)
        out.append((ids, decoder.tokenizer.encode(output, add_special_tokens=False)))
    return target, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job_id", help="the job's id (or a prefix of it)")
    ap.add_argument("--database-url", default=None, help="the job database (default: $SPEC_BATCH_DATABASE_URL)")
    ap.add_argument("--costs", default=None, help="cost of a step per verify width at batch 1: W:S,W:S,... (measured)")
    ap.add_argument("--k-max", type=int, default=16, help="most draft tokens per step")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N completed requests")
    args = ap.parse_args(argv)
    if args.database_url is None:
        from spec_batch.settings import get_settings

        args.database_url = get_settings().database_url
    target, requests = load_requests(args.database_url, args.job_id, args.limit)
    costs = step_costs(args.costs)
    cost1 = costs.estimate(1, 1) or 1.0
    out_tokens = sum(len(o) for _, o in requests)
    print(f"# replay of job {args.job_id}: {len(requests)} completed requests, {out_tokens} output tokens, target {target}")
    print(f"# step costs by verify width: {'measured (--costs)' if args.costs else 'assumed 1 + 0.04 (w - 1)'}; "
          f"k_max {args.k_max}; batch 1\n")
    print("| drafter | policy | tokens/step | acceptance | drafted/step | est. speedup vs none |")
    print("|---|---|---|---|---|---|")
    for name, make in drafters().items():
        prior = (0.2, 2.0)  # the free drafters' prior (Drafter.initial_acceptance)
        for policy in ("fixed", "adaptive"):
            st = replay(requests, make(), costs, args.k_max, adaptive=policy == "adaptive", initial_acceptance=prior)
            acc = f"{st.accepted / st.drafted:.0%}" if st.drafted else "-"
            print(f"| {name} | {policy} | {st.tokens_per_step:.2f} | {acc} | {st.drafted / max(1, st.steps):.1f} | "
                  f"{st.speedup(cost1):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
