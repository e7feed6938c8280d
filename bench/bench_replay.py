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

    python -m bench.bench_replay JOB_ID [--database-url URL] [--costs W:S,...] [--k-max 16] [--limit N]

--batch B replays the job as `spec-batch run --batch-size B` decodes it: B rows at a time, a row joining as one
finishes, one policy planning every row's length per step and learning the steps' costs as the decoder does
(`none` is replayed the same way for the ratio). A step's cost, in plain steps of its batch, is
1 + T x real draft tokens + P x padded positions (rows shorter than the longest) + J once any row drafts:
--padding-costs T,P,J, measured on your machine by bench/bench_step_costs.py (default: the default model at
batch 8 on a 2-core CPU, docs/benchmarks.md, "What a verify step costs"; on a GPU all three are near 0). The `oracle`
policy knows each row's accepted run and drafts exactly it (at batch > 1 the best shared minimum run): the ceiling of a policy on these proposals and costs.

Caveats: SQL keeps output text, so outputs are re-tokenized (a token boundary can differ from the original
ids); timing noise, caches and the prompt's prefill are not replayed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spec_batch.core.batch.planning import observe_proposal, plan_step
from spec_batch.core.batch.rows import matched_run
from spec_batch.core.drafting.drafters import Drafter, DraftRow, NgramDrafter
from spec_batch.core.drafting.job_memory import JobMemory
from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
from spec_batch.core.params import SamplingParams
from spec_batch.core.policy import DraftPolicy, RowAcceptance
from spec_batch.core.step_costs import PaddedCosts, StepCosts

Request = tuple[list[int], list[int]]  # (prompt ids, output ids)


@dataclass
class _Row:
    tokens: list[int]
    output: list[int]  # the known output the replay decodes
    acceptance: RowAcceptance
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    n_generated: int = 0
    pos: int = 0  # output tokens emitted so far


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


def width_cost(costs: StepCosts) -> Callable[[list[int]], float]:
    """A batch-1 step's cost from the table, by its verify width (1 + the row's draft)."""
    return lambda ks: costs.estimate(1, 1 + ks[0]) or 1.0  # a table from step_costs always has an estimate


def replay(
    requests: list[Request],
    new_drafter: Callable[[], Drafter],
    costs: StepCosts,
    k_max: int,
    adaptive: bool,
    initial_acceptance: tuple[float, float],
) -> ReplayStats:
    """Greedy decoding of known outputs at batch 1, request after request, with one policy for the whole job and
    the given costs by verify width (stats.cost in their units)."""
    return replay_batch(
        requests,
        new_drafter,
        1,
        k_max,
        "adaptive" if adaptive else "fixed",
        width_cost(costs),
        initial_acceptance,
        fixed_costs=costs,
    )


def padded_step_cost(lengths: list[int], per_token: float, per_pad: float, jump: float) -> float:
    """A step's cost in plain steps of its batch (see --padding-costs)."""
    longest = max(lengths, default=0)
    real = sum(lengths)
    return 1.0 + per_token * real + per_pad * (len(lengths) * longest - real) + (jump if longest else 0.0)


def replay_batch(
    requests: list[Request],
    new_drafter: Callable[[], Drafter],
    batch: int,
    k_max: int,
    policy_name: str | None,
    step_cost: Callable[[list[int]], float],
    initial_acceptance: tuple[float, float],
    fixed_costs: StepCosts | None = None,
) -> ReplayStats:
    """Greedy decoding of known outputs `batch` rows at a time, as the decoder's loop runs a job (policy_name None:
    plain decoding). The adaptive policy learns the steps' costs from step_cost, as the decoder from its clock,
    unless fixed_costs gives them by verify width."""
    policy = DraftPolicy(k_max=k_max, adaptive=policy_name != "fixed", ragged=batch > 1)
    if fixed_costs is not None:
        policy.costs = PaddedCosts.fixed(fixed_costs)
    waiting = [(p, o) for p, o in requests if p and o][::-1]
    active: list[_Row] = []
    drafter = new_drafter()
    stats = ReplayStats()
    while waiting or active:
        joining = [waiting.pop() for _ in range(min(batch - len(active), len(waiting)))]
        if joining:
            rows = [_Row(tokens=list(p), output=o, acceptance=RowAcceptance(*initial_acceptance)) for p, o in joining]
            drafter.admit(rows)
            active += rows
        proposals: list[list[int]] = [[] for _ in active]
        confidence: list[list[float] | None] = [None] * len(active)
        ks = [0] * len(active)
        if policy_name is not None:
            budget = [len(r.output) - r.pos - 1 for r in active]
            choose = _oracle(active, step_cost) if policy_name == "oracle" else None
            draft, full = plan_step(drafter, policy, active, budget, choose)  # the decoder's own planning
            proposals, ks = full.tokens, [len(t) for t in draft.tokens]
            confidence = list(full.confidence) if full.confidence is not None else [None] * len(active)
        cost = step_cost(ks)
        stats.cost += cost
        stats.steps += len(active)  # row steps: tokens per step is per row, as the decoder reports it
        accepted = [matched_run(p[:k], r.output[r.pos :]) for p, k, r in zip(proposals, ks, active)]
        drafter.feedback(active, ks, accepted)  # before the tokens are appended, as the decoder calls it
        for row, proposal, conf, k, a in zip(active, proposals, confidence, ks, accepted):
            emitted = row.output[row.pos : row.pos + a + 1]
            observe_proposal(policy, row.acceptance, proposal, conf, emitted, a, drafter.free)
            stats.drafted += k
            stats.accepted += a
            stats.tokens += len(emitted)
            row.tokens += emitted
            row.n_generated += len(emitted)
            row.pos += len(emitted)
        if fixed_costs is None:
            policy.observe_step(len(active), ks, cost)
        keep = [b for b, r in enumerate(active) if r.pos < len(r.output)]
        if len(keep) < len(active):
            drafter.keep_rows(keep)  # the finished rows leave: a job memory takes their whole outputs
            active = [active[b] for b in keep]
            if not active:
                drafter = new_drafter()
    return stats


def _oracle(rows: list[_Row], step_cost: Callable[[list[int]], float]) -> Callable[[list[list[int]]], list[int]]:
    """Lengths that know each row's accepted run: at batch > 1 the shared minimum run with the best tokens per cost."""

    def choose(proposals: list[list[int]]) -> list[int]:
        runs = [matched_run(p, r.output[r.pos :]) for p, r in zip(proposals, rows)]
        return max(
            ([k if k >= t else 0 for k in runs] for t in sorted(set(runs) | {0})),
            key=lambda kk: (len(kk) + sum(kk)) / step_cost(kk),
        )

    return choose


class _JobSuffixDrafter(SuffixDrafter):
    """The suffix drafter whose rows all belong to one job: they join with its memory."""

    def __init__(self, memory: JobMemory):
        super().__init__()
        self.job_memory = memory

    def admit(self, rows: Sequence[DraftRow], memory: JobMemory | None = None) -> None:
        super().admit(rows, memory or self.job_memory)


def drafters() -> dict[str, Callable[[], Callable[[], Drafter]]]:
    """name -> a maker of the per-replay drafter factory (a job memory is one per replay)."""

    def with_memory() -> Callable[[], Drafter]:
        memory = JobMemory()
        return lambda: _JobSuffixDrafter(memory)

    return {
        "ngram": lambda: NgramDrafter,
        "suffix": lambda: SuffixDrafter,
        "suffix + job memory": with_memory,
    }


def load_requests(database_url: str, job_id: str, limit: int | None) -> tuple[str, list[Request]]:
    """The job's target and its completed requests as (prompt ids, output ids), in the order they completed."""
    from spec_batch import load_decoder
    from spec_batch.openai_format.prompts import build_prompt
    from spec_batch.store import make_session_factory, queries

    factory = make_session_factory(database_url)
    with factory() as s:
        job_id = queries.resolve_job_id(s, job_id)
        target = queries.get_job(s, job_id).target
        rows = [
            (r.completed_at, r.id, r.endpoint, r.prompt, r.output)
            for r in queries.iter_requests(s, job_id)
            if r.status == "completed" and r.output is not None
        ]
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
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (spec-batch run --batch-size)")
    ap.add_argument(
        "--padding-costs",
        default="0.036,0.003,0.035",
        help="T,P,J at --batch > 1: a step costs 1 + T x draft tokens + P x padded positions + J if any drafts",
    )
    args = ap.parse_args(argv)
    if args.batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {args.batch}")
    try:
        per_token, per_pad, jump = (float(x) for x in args.padding_costs.split(","))
    except ValueError:
        raise SystemExit(f"--padding-costs takes three numbers T,P,J, got {args.padding_costs!r}") from None
    if args.database_url is None:
        from spec_batch.settings import get_settings

        args.database_url = get_settings().database_url
    target, requests = load_requests(args.database_url, args.job_id, args.limit)
    costs = step_costs(args.costs)
    fixed = costs if args.batch == 1 else None  # batch 1: the table's costs by verify width, as given
    if args.batch == 1:
        step_cost = width_cost(costs)
        cost_text = f"by verify width: {'measured (--costs)' if args.costs else 'assumed 1 + 0.04 (w - 1)'}"
    else:
        step_cost = lambda ks: padded_step_cost(ks, per_token, per_pad, jump)
        cost_text = f"1 + {per_token} x draft tokens + {per_pad} x padded positions + {jump} if any row drafts"
    prior = (0.2, 2.0)  # the free drafters' prior (Drafter.initial_acceptance)
    plain = replay_batch(requests, NgramDrafter, args.batch, args.k_max, None, step_cost, prior, fixed)
    out_tokens = sum(len(o) for _, o in requests)
    print(
        f"# replay of job {args.job_id}: {len(requests)} completed requests, {out_tokens} output tokens, target {target}"
    )
    print(f"# step costs {cost_text}; k_max {args.k_max}; batch {args.batch}\n")
    print("| drafter | policy | tokens/step | acceptance | drafted/step | est. speedup vs none |")
    print("|---|---|---|---|---|---|")
    for name, make in drafters().items():
        for policy in ("fixed", "adaptive", "oracle"):
            st = replay_batch(requests, make(), args.batch, args.k_max, policy, step_cost, prior, fixed)
            ratio = plain.cost / st.cost  # the same tokens, costed alike
            acc = f"{st.accepted / st.drafted:.0%}" if st.drafted else "-"
            print(
                f"| {name} | {policy} | {st.tokens_per_step:.2f} | {acc} | {st.drafted / max(1, st.steps):.1f} | "
                f"{ratio:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
