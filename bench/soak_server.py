"""The server held under load for a given time (a soak test, not a timed test): `spec-batch serve` as a real
subprocess on 127.0.0.1, under a mix of clients, with its resources recorded every minute and a check at the end.

The mix (each client a thread, its loop bounded in count and time): 8 streaming chat clients (the official `openai`
client), 4 non-streaming clients with `tools` or a `json_schema` response_format, 1 client uploading and running
small batches (the Batch API, `openai` client; some cancelled while they run, each with one line that fails alone),
2 clients that drop their stream after a few chunks, 1 client sending bad requests (each must get its 4xx).

Every minute (`--interval`): the server's RSS, open file descriptors, threads and database connections
(PostgreSQL: its rows in pg_stat_activity; SQLite: its open handles on the database file), and of the requests
that ended in that minute: done, cancelled, errors, p50/p95 latency of the online answers, tokens/s (online and
batch completion tokens). At the end, after the clients stop (running batches get `--drain-minutes` to end):
every request not cancelled by its client got exactly one complete answer, every batch line is in exactly one
result file, no row is left in progress (/metrics), and the server exits cleanly on SIGTERM; exit 1 otherwise.
The table is printed; `--out` gets the JSON (every minute, totals, errors, the check).

    python -m bench.soak_server --minutes 5 --out soak.json                  # SQLite in a temporary directory
    python -m bench.soak_server --minutes 30 --database-url postgresql+psycopg://postgres@127.0.0.1:5432/soak \\
        --out soak-pg.json                                                   # an existing database, migrated here
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.serve_process import ServeProcess
from bench.soak_batches import batch_once
from bench.soak_clients import Config, bad_once, client_loop, disconnect_once, streaming_once, structured_once
from bench.soak_monitor import HEADER, DbConnections, Ledger, Sampler, latency_drift, minute_dicts, table_row

KEY = "sk-soak"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long the clients send (default 60)")
    p.add_argument("--out", type=Path, required=True, help="the JSON results")
    p.add_argument("--database-url", default="", help="the server's database (default: SQLite in --workdir)")
    p.add_argument("--workdir", type=Path, default=None, help="the server's directory (default: a temporary one)")
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="suffix")
    p.add_argument("--max-batch", type=int, default=16, help="the engine's rows at once (spec-batch serve)")
    p.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the server")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--streaming", type=int, default=8, help="streaming chat clients")
    p.add_argument("--structured", type=int, default=4, help="non-streaming clients with tools or json_schema")
    p.add_argument("--disconnecting", type=int, default=2, help="clients that drop their stream")
    p.add_argument("--bad", type=int, default=1, help="clients sending bad requests")
    p.add_argument("--batch-clients", type=int, default=1)
    p.add_argument("--batch-lines", type=int, default=6, help="lines per batch file (the last fails alone)")
    p.add_argument("--cancel-share", type=float, default=0.2, help="share of batches cancelled while running")
    p.add_argument("--max-requests", type=int, default=100_000, help="at most this many requests per client")
    p.add_argument("--interval", type=float, default=60.0, help="seconds per row of the table")
    p.add_argument("--drain-minutes", type=float, default=10.0, help="time running batches get after the end")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[ServeProcess, str]:
    db_url = args.database_url or f"sqlite:///{workdir / 'soak.db'}"
    if db_url.startswith("postgresql"):
        from spec_batch.store import migrate_to_head

        migrate_to_head(db_url)
    env = {"OMP_NUM_THREADS": args.threads, "SPEC_BATCH_DATABASE_URL": db_url}
    serve_args = ("--target", args.target, "--draft", args.draft, "--max-batch", str(args.max_batch))
    server = ServeProcess(workdir, *serve_args, keys=KEY, env=env).start(timeout=900)
    return server, db_url


def client_threads(args, server: ServeProcess, ledger: Ledger, deadline: float, hard: float) -> list[threading.Thread]:
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300)
    http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    cfg = Config(server.base_url, KEY, args.max_tokens, deadline, args.max_requests)
    plan = (
        [(f"stream-{i}", streaming_once(client, cfg), 1.0) for i in range(args.streaming)]
        + [(f"structured-{i}", structured_once(client, cfg), 1.0) for i in range(args.structured)]
        + [(f"disconnect-{i}", disconnect_once(http, cfg), 3.0) for i in range(args.disconnecting)]
        + [(f"bad-{i}", bad_once(http), 5.0) for i in range(args.bad)]
        + [
            (f"batch-{i}", batch_once(client, cfg, args.batch_lines, args.cancel_share, hard), 5.0)
            for i in range(args.batch_clients)
        ]
    )
    return [
        threading.Thread(target=client_loop, args=(name, once, cfg, ledger, pause), name=name, daemon=True)
        for name, once, pause in plan
    ]


def metric(server: ServeProcess, name: str, label: str = "") -> float:
    """The sum of a /metrics sample over its label sets (those holding `label`, e.g. 'status="completed"')."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    rows = [line for line in text.splitlines() if line.startswith(name + "{") and label in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in rows)


def in_progress(server: ServeProcess) -> float:
    return metric(server, "spec_batch_requests_in_progress")


def settled_in_progress(server: ServeProcess, within: float = 60) -> float:
    """The in-progress gauge once it reads 0, or what it still reads after `within` seconds."""
    deadline = time.monotonic() + within
    while (value := in_progress(server)) and time.monotonic() < deadline:
        time.sleep(1)
    return value


def run_soak(args, server: ServeProcess, db_url: str) -> tuple[Ledger, Sampler, dict]:
    ledger = Ledger()
    start = time.monotonic()
    deadline, hard = start + args.minutes * 60, start + args.minutes * 60 + args.drain_minutes * 60
    db = DbConnections(db_url, server.process.pid)
    sampler = Sampler(ledger, server.process.pid, db, args.interval, start)
    threads = client_threads(args, server, ledger, deadline, hard)
    print(HEADER, flush=True)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, hard + 120 - time.monotonic()))
    sampler.stop.set()
    sampler.join()
    last = sampler.close_window()
    stuck = [t.name for t in threads if t.is_alive()]
    end = {"stuck_clients": stuck, "in_progress_at_end": settled_in_progress(server), "final": table_row(last)}
    end["db_connections_at_end"] = db.count()
    end["server_counted"] = {
        status: metric(server, "spec_batch_requests_total", f'status="{status}"') for status in ("completed", "failed")
    }
    db.close()
    return ledger, sampler, end


def totals(ledger: Ledger) -> dict[str, dict[str, int]]:
    by_kind: dict[str, Counter] = {}
    for r in ledger.all():
        by_kind.setdefault(r.kind, Counter())[r.outcome] += 1
    return {kind: dict(c) for kind, c in sorted(by_kind.items())}


def counted_problems(ledger: Ledger, counted: dict[str, float] | None) -> list[str]:
    """The server's count of online requests answered (/metrics; batch rows run locally are not counted there)
    against the clients': each answer the clients got counted once; a dropped stream counted at most once (the
    server may finish it before it sees the client go); none failed."""
    if counted is None:
        return []
    online = [r for r in ledger.all() if r.kind in ("stream", "tools", "json_schema", "disconnect")]
    answered = sum(r.outcome == "complete" for r in online)
    dropped = sum(r.outcome == "cancelled" for r in online)
    found = [] if not counted["failed"] else [f"the server counts {counted['failed']:.0f} failed requests"]
    if not answered <= counted["completed"] <= answered + dropped:
        found.append(
            f"the server counts {counted['completed']:.0f} answers; the clients got {answered} ({dropped} dropped)"
        )
    return found


def failures(ledger: Ledger, end: dict, exit_status: int | None, log: str) -> list[str]:
    """What the final check refuses (empty: the soak held)."""
    found = [f"{r.kind}: {r.detail}" for r in ledger.all() if r.outcome == "error"]
    if not any(r.kind == "stream" and r.outcome == "complete" for r in ledger.all()):
        found.append("no streamed answer completed")
    if not any(r.kind == "batch" and r.outcome == "complete" for r in ledger.all()):
        found.append("no batch completed")
    if end["stuck_clients"]:
        found.append(f"clients still running at the end: {end['stuck_clients']}")
    if end["in_progress_at_end"]:
        found.append(f"/metrics still counts {end['in_progress_at_end']} requests in progress")
    found += counted_problems(ledger, end.get("server_counted"))
    if exit_status not in (0, -15):
        found.append(f"the server exited {exit_status} on SIGTERM")
    return found


def summary(args, ledger: Ledger, sampler: Sampler, end: dict, exit_status, log: str, db_url: str) -> dict:
    minutes = minute_dicts(sampler.minutes)
    at5 = next((m for m in minutes if m["minute"] >= 5), None)
    return {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join(["python -m bench.soak_server", *args.argv]),
        "database": db_url.split(":", 1)[0],
        "minutes": args.minutes,
        "rss_mb_at_minute_5": at5 and at5["rss_mb"],
        "rss_mb_at_end": minutes[-1]["rss_mb"] if minutes else None,
        "latency_drift": latency_drift(sampler.minutes),
        "totals": totals(ledger),
        "end": end,
        "server_exit_status": exit_status,
        "log_tracebacks": log.count("Traceback (most recent call last)"),
        "log_errors": [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line][:20],
        "failures": failures(ledger, end, exit_status, log),
        "per_minute": minutes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        workdir = args.workdir or Path(tmp)
        server, db_url = start_server(args, workdir)
        try:
            ledger, sampler, end = run_soak(args, server, db_url)
        finally:
            exit_status = server.stop(timeout=300)
        result = summary(args, ledger, sampler, end, exit_status, server.output(), db_url)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "per_minute"}, indent=2))
    print("soak: " + ("FAILED" if result["failures"] else "held") + f" (results in {args.out})")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
