"""Online serving: aggregate tokens/s and request latency (p50/p95) for 1, 4, 8 and 16 concurrent chat clients,
with speculation on (the drafter given) and off (`none`), each against its own `spec-batch serve` process.

Every client sends chat requests one after another (the official `openai` client, greedy, max_tokens fixed) for
--requests requests per level; aggregate tokens/s = all completion tokens / the level's wall time. Both servers
run side by side and take turns level by level (which goes first alternates), so a machine whose speed drifts
over minutes drifts for both; `--runs N` repeats the whole, each run with two servers started for it (a process's
speed can sit ~10% off another's for its whole life), and prints the medians of the runs. Concurrent
clients share the engine's steps (continuous batching), so tokens/s should grow with clients, and speculation at 1
client should keep the core's batch-1 ratio (bench_core). Timings belong in docs/benchmarks.md, run on a quiet
machine.

    python -m bench.bench_server                       # default model, ngram vs none, 1/4/8/16 clients
    python -m bench.bench_server --draft suffix --requests 64 --runs 3   # the issue's bar: medians of 3 runs
    python -m bench.bench_server --clients 1,2 --requests 4 --max-tokens 16   # a smoke run
    python -m bench.bench_server --draft suffix --burner 1   # beside a CPU-heavy process (SPEC_BATCH_ADAPT_THREADS=0:
                                                             # the servers keep their thread count)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.burner import burners
from bench.prompts import SETS
from bench.serve_process import ServeProcess


@dataclass
class Level:
    clients: int
    tokens: int
    wall_s: float
    latencies: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def latency(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _one(client, prompt: str, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    return reply.usage.completion_tokens, time.perf_counter() - t0


def run_level(base_url: str, clients: int, prompts: list[str], requests: int, max_tokens: int) -> Level:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    jobs = [prompts[i % len(prompts)] for i in range(max(requests, clients))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:  # `clients` requests in flight at any time
        done = list(pool.map(lambda p: _one(client, p, max_tokens), jobs))
    wall = time.perf_counter() - t0
    return Level(clients, sum(t for t, _ in done), wall, [s for _, s in done])


def start_server(workdir: Path, args: argparse.Namespace, draft: str) -> ServeProcess:
    slack = ["--latency-slack", args.latency_slack] if args.latency_slack and draft != "none" else []
    server = ServeProcess(
        workdir, "--target", args.target, "--draft", draft, "--max-batch", str(args.max_batch), *slack
    )
    server.start()
    return server


def bench_interleaved(
    on: ServeProcess, off: ServeProcess, args: argparse.Namespace, prompts: list[str], turn: int
) -> tuple[list[Level], list[Level]]:
    """One run of every level on both servers, taking turns: at each level the one that went second before goes
    first (turn: the run's offset, so that a level's order alternates across runs too)."""
    levels: dict[str, list[Level]] = {"on": [], "off": []}
    for i, clients in enumerate(args.clients):
        order = [("on", on), ("off", off)] if (turn + i) % 2 == 0 else [("off", off), ("on", on)]
        for name, server in order:
            levels[name].append(run_level(server.base_url, clients, prompts, args.requests, args.max_tokens))
    return levels["on"], levels["off"]


def report(on: list[Level], off: list[Level], draft: str) -> str:
    lines = [
        f"{'clients':>7} | {draft + ' tok/s':>12} {'p50 s':>7} {'p95 s':>7} | {'none tok/s':>10} {'p50 s':>7} "
        f"{'p95 s':>7} | {'speedup':>7} | {'x 1 client':>10}"
    ]
    base = on[0].tokens_per_s if on else 0.0
    for a, b in zip(on, off):
        speedup = a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
        scale = a.tokens_per_s / base if base else float("nan")
        lines.append(
            f"{a.clients:>7} | {a.tokens_per_s:>12.1f} {a.latency(0.5):>7.2f} {a.latency(0.95):>7.2f} | "
            f"{b.tokens_per_s:>10.1f} {b.latency(0.5):>7.2f} {b.latency(0.95):>7.2f} | {speedup:>7.2f} | "
            f"{scale:>10.2f}"
        )
    return "\n".join(lines)


def report_medians(runs: list[tuple[list[Level], list[Level]]], draft: str) -> str:
    """Per level: the median tokens/s and p95 of each server, and the median of the runs' own ratios."""
    lines = [
        f"{'clients':>7} | {draft + ' tok/s':>12} {'p95 s':>7} | {'none tok/s':>10} {'p95 s':>7} | tok/s ratio | p95 ratio"
    ]
    for i, level in enumerate(runs[0][0]):
        pairs = [(on[i], off[i]) for on, off in runs]
        speed = [a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan") for a, b in pairs]
        tail = [a.latency(0.95) / b.latency(0.95) if b.latency(0.95) else float("nan") for a, b in pairs]
        lines.append(
            f"{level.clients:>7} | {statistics.median(a.tokens_per_s for a, _ in pairs):>12.1f} "
            f"{statistics.median(a.latency(0.95) for a, _ in pairs):>7.2f} | "
            f"{statistics.median(b.tokens_per_s for _, b in pairs):>10.1f} "
            f"{statistics.median(b.latency(0.95) for _, b in pairs):>7.2f} | "
            f"{statistics.median(speed):.2f} ({', '.join(f'{x:.2f}' for x in speed)}) | "
            f"{statistics.median(tail):.2f} ({', '.join(f'{x:.2f}' for x in tail)})"
        )
    return "\n".join(lines)


def bench_fresh_servers(args: argparse.Namespace, prompts: list[str], turn: int) -> tuple[list[Level], list[Level]]:
    """One run against two servers started for it: a process's speed on a VM can sit ~10% off another's for its
    whole life (the same decode, one process after another, 463-485 against 540-569 tokens/s on the Zen 5 VM of
    docs/benchmarks.md), so servers kept across runs would carry one pair's bias into every run's ratio."""
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        servers = [start_server(Path(tmp), args, draft) for draft in (args.draft, "none")]
        try:
            for server in servers:
                run_level(server.base_url, 1, prompts[:1], 1, args.max_tokens)  # warm-up (untimed)
            with burners(args.burner):  # a busy machine: both servers beside the same burners
                return bench_interleaved(*servers, args, prompts, turn)
        finally:
            for server in servers:
                server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="ngram", help="the drafter of the speculation-on server")
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least one per client)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16, help="the engine's rows at once (spec-batch serve)")
    parser.add_argument("--set", dest="prompt_set", default="edits", choices=sorted(SETS))
    parser.add_argument("--runs", type=int, default=1, help="whole runs, interleaved; medians printed")
    parser.add_argument(
        "--latency-slack", default=None, help="the speculation-on server's --latency-slack (default: the server's)"
    )
    parser.add_argument(
        "--burner",
        type=int,
        default=0,
        help="CPU-burning processes beside the servers while they are timed (bench/burner.py; default none)",
    )
    args = parser.parse_args(argv)
    prompts = SETS[args.prompt_set]
    runs: list[tuple[list[Level], list[Level]]] = []
    for turn in range(args.runs):
        runs.append(bench_fresh_servers(args, prompts, turn))
    print(
        f"target {args.target}, set {args.prompt_set}, {args.requests} requests/level, max_tokens "
        f"{args.max_tokens}, engine max_batch {args.max_batch}, latency slack {args.latency_slack or 'default'}"
        + (f", beside {args.burner} CPU burner(s)" if args.burner else "")
    )
    for r, (on, off) in enumerate(runs):
        if len(runs) > 1:
            print(f"run {r + 1} of {len(runs)}:")
        print(report(on, off, args.draft))
    if len(runs) > 1:
        print(f"medians of {len(runs)} runs (each run's value in brackets):")
        print(report_medians(runs, args.draft))
    on = [level for run in runs for level in run[0]]
    print(f"median latency over levels: {statistics.median(x.latency(0.5) for x in on):.2f} s ({args.draft})")


if __name__ == "__main__":
    main()
