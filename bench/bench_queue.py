"""The queue's cost: the same job in-process and through Redis to one Celery worker, then with two workers.

    .venv/bin/python -m bench.bench_queue                       # 64 requests, default model, max_tokens 32
    .venv/bin/python -m bench.bench_queue --requests 64 --max-tokens 32 --repeats 2 --json out/bench_queue.json

What is measured (the model is loaded and warmed up everywhere first; model loading is reported apart):

- in-process: ``create_job_from_file`` + ``run_job`` on a loaded decoder (what ``spec-batch run`` does), from the
  start of job creation to the job's completion;
- queue, 1 worker: ``submit_file`` (what ``spec-batch submit`` does) to the job's ``completed_at``, through a
  warm ``spec-batch worker`` (private Redis, the same SQLite file);
- queue overhead: what the queue adds to the job's wall time (publishing, delivery, claims, leases and
  heartbeats, finalization), as a share of the queue job's wall time. Target: <= 5% for 64 requests.
  Reported two ways: the direct difference of the two wall times, and (the headline, robust to a machine
  whose load changes the decoding speed between runs) the difference of the time each spends *around*
  decoding: wall time minus the seconds inside decoder.generate() (jobs.decode_wall_s). Also the CPU seconds
  of each side (this process in-process; the submitter plus the worker's main and pool processes through the
  queue): what the queue costs in work, whatever the load;
- throughput with 1 and 2 workers: requests/s and output tokens/s over the job's wall time.

Same batch size, chunk size = the runner's claim group (4 x batch size), no baseline sample on either side.
The worker gets as many torch threads as this process has (1 worker) or cores / 2 each (2 workers).
On a shared machine, timings move with the load: --repeats N alternates in-process and queue runs and
reports each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path

from bench.processes import RedisServer, WorkerProcess, redis_ping, wait_for, worker_env
from bench.prompts import SETS

REPO = Path(__file__).resolve().parents[1]


def write_batch(path: Path, n: int, max_tokens: int) -> Path:
    prompts = [p for name in ("edits", "json", "code", "free") for p in SETS[name]]
    lines = []
    for i in range(n):
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": max_tokens,
        }
        lines.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def job_wall(factory, job_id: str, t_start_utc) -> dict:
    """The job's wall time (start -> completed_at), its output tokens, and the seconds spent inside
    decoder.generate() (jobs.decode_wall_s): wall - decode is what surrounds decoding."""
    from spec_batch.store import queries, summaries

    with factory() as s:
        job = queries.get_job(s, job_id)
        row = summaries.job_summary_row(s, job_id)
    assert job.status == "completed", (job_id, job.status)
    wall = (job.completed_at - t_start_utc).total_seconds()
    return {
        "job": job_id,
        "wall_s": wall,
        "output_tokens": int(row["output_tokens"] or 0),
        "decode_s": float(job.decode_wall_s),
        "around_s": wall - float(job.decode_wall_s),
    }


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of these processes so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def run_in_process(factory, path: Path, decoder, batch_size: int) -> dict:
    from datetime import datetime

    from spec_batch.jobs import create_job_from_file, run_job

    c0 = time.process_time()
    t0 = datetime.now(UTC)
    job_id, _ = create_job_from_file(
        factory, path, target="default", drafter="ngram", batch_size=batch_size, baseline_sample=0
    )
    run_job(factory, job_id, decoder)
    out = job_wall(factory, job_id, t0)
    out["cpu_s"] = time.process_time() - c0
    return out


def run_queue(
    factory,
    path: Path,
    broker_url: str,
    batch_size: int,
    chunk_size: int,
    queue: str | None = None,
    timeout: float = 3600,
    workers: list[WorkerProcess] = (),
) -> dict:
    from datetime import datetime

    from spec_batch.store import queries
    from spec_batch.workers.enqueue import submit_file

    pids = [p for w in workers for p in (w.pid, *w.children())]
    w0 = cpu_seconds(pids)
    t0 = datetime.now(UTC)
    c0 = time.process_time()
    res = submit_file(
        factory,
        path,
        target="default",
        drafter="ngram",
        batch_size=batch_size,
        baseline_sample=0,
        chunk_size=chunk_size,
        broker_url=broker_url,
        queue=queue,
    )
    submit_cpu = time.process_time() - c0

    def done():
        with factory() as s:
            return queries.get_job(s, res.job_id).status in ("completed", "failed", "cancelled")

    wait_for(done, timeout, 0.05, what=f"job {res.job_id}")
    out = job_wall(factory, res.job_id, t0)
    out["cpu_s"] = submit_cpu + cpu_seconds(pids) - w0  # the submitter's and the workers' (main + pool)
    return out


def warm(factory, workdir: Path, broker_url: str, queue: str, batch_size: int) -> float:
    """One small job on `queue` (served by one worker only): loads and warms that worker's model."""
    path = write_batch(workdir / f"warm-{queue}.jsonl", 2, 4)
    return run_queue(factory, path, broker_url, batch_size, 4 * batch_size, queue=queue)["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=None, help="default: 4 x batch size (the runner's group)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads in-process and in the 1-worker run (default: torch's default); the "
        "2-worker run gives each worker cores / 2. On a busy machine, 1 avoids the collapse of "
        "multi-threaded torch when cores are oversubscribed",
    )
    ap.add_argument("--no-two-workers", action="store_true", help="skip the 2-worker throughput run")
    ap.add_argument(
        "--broker-url",
        default=None,
        help="default: a private redis-server on a free port (needs the redis-server binary)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    chunk_size = args.chunk_size or 4 * args.batch_size

    import torch

    from spec_batch import load_decoder
    from spec_batch.store import make_session_factory, migrate_to_head
    from spec_batch.workers.routing import queue_name

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    work = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    server = None
    if args.broker_url:
        broker_url = args.broker_url
        if not redis_ping(broker_url):
            sys.exit(f"Redis at {broker_url} cannot be reached")
    elif shutil.which("redis-server"):
        server = RedisServer(work / "redis").start()
        broker_url = server.url
    else:
        sys.exit("no redis-server binary: pass --broker-url redis://HOST:PORT/DB (a database it may flush)")
    db_url = f"sqlite:///{work / 'bench.db'}"
    migrate_to_head(db_url)
    factory = make_session_factory(db_url)
    path = write_batch(work / "batch.jsonl", args.requests, args.max_tokens)
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    workers: list[WorkerProcess] = []
    out: dict = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "chunk_size": chunk_size,
        "torch_threads_in_process": threads,
        "cores": cores,
        "runs": [],
    }
    try:
        t = time.perf_counter()
        decoder = load_decoder("default", "ngram")
        out["in_process_load_s"] = time.perf_counter() - t
        from spec_batch.core.params import SamplingParams

        decoder.generate(["Warm up."], SamplingParams(max_new_tokens=4), batch_size=1)
        run_in_process(factory, write_batch(work / "warm-ip.jsonl", 2, 4), decoder, args.batch_size)

        default_q = queue_name("default", "ngram")
        env1 = worker_env(db_url, broker_url, lease_seconds=300, SPEC_BATCH_TORCH_THREADS=str(threads))
        w1 = WorkerProcess("bench1", env1, work, "-Q", f"{default_q},warm-1").start()
        workers.append(w1)
        w1.wait_ready(300)
        out["worker_first_job_s"] = warm(factory, work, broker_url, "warm-1", args.batch_size)  # incl. model load

        inproc, queued = [], []
        for r in range(args.repeats):
            a = run_in_process(factory, path, decoder, args.batch_size)
            b = run_queue(factory, path, broker_url, args.batch_size, chunk_size, workers=[w1])
            inproc.append(a)
            queued.append(b)
            ov = (b["wall_s"] - a["wall_s"]) / b["wall_s"]
            added = (b["around_s"] - a["around_s"]) / b["wall_s"]
            cpu = (b["cpu_s"] - a["cpu_s"]) / b["cpu_s"]
            out["runs"].append(
                {
                    "repeat": r,
                    "in_process": a,
                    "queue_1_worker": b,
                    "overhead_direct": ov,
                    "overhead_added": added,
                    "overhead_cpu": cpu,
                }
            )
            print(
                f"run {r}: in-process {a['wall_s']:.2f}s (decode {a['decode_s']:.2f}s, CPU {a['cpu_s']:.1f}s), "
                f"queue (1 worker) {b['wall_s']:.2f}s (decode {b['decode_s']:.2f}s, CPU {b['cpu_s']:.1f}s); "
                f"wall difference {100 * ov:+.1f}%, added around decoding {100 * added:+.2f}%, CPU "
                f"{100 * cpu:+.1f}% (output tokens {a['output_tokens']} / {b['output_tokens']})",
                flush=True,
            )
        ip = statistics.median(x["wall_s"] for x in inproc)
        q1 = statistics.median(x["wall_s"] for x in queued)
        out["in_process_s"] = ip
        out["queue_1_worker_s"] = q1
        out["queue_overhead_direct"] = (q1 - ip) / q1
        out["queue_overhead"] = statistics.median(r["overhead_added"] for r in out["runs"])
        out["queue_overhead_cpu"] = statistics.median(r["overhead_cpu"] for r in out["runs"])
        out["around_decoding_s"] = {
            "in_process": statistics.median(x["around_s"] for x in inproc),
            "queue_1_worker": statistics.median(x["around_s"] for x in queued),
        }
        tokens = statistics.median(x["output_tokens"] for x in queued)
        out["throughput_1_worker"] = {"requests_per_s": args.requests / q1, "tokens_per_s": tokens / q1}

        if not args.no_two_workers:
            w1.stop()
            per = str(max(1, cores // 2) if not args.torch_threads else min(args.torch_threads, max(1, cores // 2)))
            env2 = worker_env(db_url, broker_url, lease_seconds=300, SPEC_BATCH_TORCH_THREADS=per)
            ws = [WorkerProcess(f"bench2{i}", env2, work, "-Q", f"{default_q},warm-2{i}").start() for i in "ab"]
            workers.extend(ws)
            for w in ws:
                w.wait_ready(300)
            for i in "ab":
                warm(factory, work, broker_url, f"warm-2{i}", args.batch_size)
            runs2 = [
                run_queue(factory, path, broker_url, args.batch_size, chunk_size, workers=ws)
                for _ in range(args.repeats)
            ]
            q2 = statistics.median(x["wall_s"] for x in runs2)
            tokens2 = statistics.median(x["output_tokens"] for x in runs2)
            out["queue_2_workers_s"] = q2
            out["torch_threads_per_worker_2"] = int(per)
            out["throughput_2_workers"] = {"requests_per_s": args.requests / q2, "tokens_per_s": tokens2 / q2}
            out["scaling_2_vs_1"] = q1 / q2
    finally:
        for w in workers:
            w.stop()
        if server is not None:
            server.stop()

    print()
    print(
        f"job: {args.requests} chat requests, max_tokens {args.max_tokens}, batch {args.batch_size}, "
        f"chunk {chunk_size}; {cores} cores"
    )
    print(f"in-process            {out['in_process_s']:8.2f} s")
    print(
        f"queue, 1 worker       {out['queue_1_worker_s']:8.2f} s   (direct difference "
        f"{100 * out['queue_overhead_direct']:+.1f}%: decode speed moves with the machine's load)"
    )
    ar = out["around_decoding_s"]
    print(
        f"queue overhead        {100 * out['queue_overhead']:+8.2f} % of the job's wall time (target <= 5%): "
        f"time around decoding {ar['queue_1_worker']:.2f} s through the queue vs {ar['in_process']:.2f} s "
        f"in-process; CPU seconds {100 * out['queue_overhead_cpu']:+.1f}%"
    )
    t1 = out["throughput_1_worker"]
    print(
        f"throughput, 1 worker  {t1['requests_per_s']:8.3f} req/s  {t1['tokens_per_s']:8.1f} tokens/s "
        f"({threads} torch threads)"
    )
    if "throughput_2_workers" in out:
        t2 = out["throughput_2_workers"]
        print(
            f"throughput, 2 workers {t2['requests_per_s']:8.3f} req/s  {t2['tokens_per_s']:8.1f} tokens/s "
            f"({out['torch_threads_per_worker_2']} torch thread(s) each; x{out['scaling_2_vs_1']:.2f} vs 1)"
        )
    print(
        f"model load: in-process {out['in_process_load_s']:.1f} s; a worker's first job (load + 2 requests) "
        f"{out['worker_first_job_s']:.1f} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
