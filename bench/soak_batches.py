"""The soak test's batch client (bench/soak_server.py), through the official `openai` client: uploads a small JSONL
file (one line with a bad body, which must fail alone), creates a batch, polls it, cancels some while they run,
downloads the output and error files, deletes the upload, and checks that every line of the file is in exactly one
result file, once, with request_counts that add up. Polling is bounded: past `hard_deadline` the batch is
cancelled, and one that does not end within a minute more is an error.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable

from bench.soak_clients import PROMPTS, Config, _err
from bench.soak_monitor import Record

TERMINAL = ("completed", "failed", "cancelled", "expired")


def batch_file(rng: random.Random, tag: str, lines: int, max_tokens: int) -> tuple[list[str], str, bytes]:
    """`lines` chat lines, the last with a body that fails alone (temperature out of range): (ids, bad id, bytes)."""
    ids, out = [], []
    for i in range(lines):
        custom_id = f"{tag}-{i}"
        body = {"model": "default", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        body |= {"max_tokens": max_tokens, "temperature": -1 if i == lines - 1 else 0}
        ids.append(custom_id)
        out.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ids, ids[-1], ("\n".join(out) + "\n").encode()


def wait_for(client, batch_id: str, cancel_after: float | None, hard_deadline: float):
    """Polls until the batch ends; cancels it `cancel_after` s after it starts running, or at hard_deadline.
    Returns the batch and whether it was cancelled."""
    running_since, cancelled = None, False
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch, cancelled
        now = time.monotonic()
        if batch.status == "in_progress" and running_since is None:
            running_since = now
        due = running_since is not None and cancel_after is not None and now - running_since >= cancel_after
        if not cancelled and (due or now >= hard_deadline):
            client.batches.cancel(batch_id)
            cancelled = True
        if now >= hard_deadline + 60:
            raise TimeoutError(f"{batch_id} still {batch.status} a minute past the hard deadline")
        time.sleep(1.0)


def result_ids(client, file_id: str | None) -> tuple[list[str], int]:
    """The custom_ids of a result file, in order, and the completion tokens of its successful lines."""
    if not file_id:
        return [], 0
    ids, tokens = [], 0
    for line in client.files.content(file_id).text.splitlines():
        row = json.loads(line)
        ids.append(row["custom_id"])
        body = (row.get("response") or {}).get("body") or {}
        tokens += (body.get("usage") or {}).get("completion_tokens", 0) if not row.get("error") else 0
    return ids, tokens


def batch_problem(batch, ids: list[str], bad_id: str, out_ids: list[str], err_ids: list[str], cancel: bool) -> str:
    expected = ("completed", "cancelled") if cancel else ("completed",)
    if batch.status not in expected:
        return f"{batch.id} ended {batch.status} {getattr(batch, 'errors', None)}"
    seen = Counter(out_ids + err_ids)
    if seen != Counter(ids):
        missing, extra = set(ids) - set(seen), {k: n for k, n in seen.items() if n != 1 or k not in ids}
        return f"{batch.id}: lines missing {sorted(missing)[:5]}, repeated or unknown {extra}"
    if bad_id not in err_ids:
        return f"{batch.id}: the bad line {bad_id} is not in the error file"
    counts = batch.request_counts
    if (counts.total, counts.completed, counts.failed) != (len(ids), len(out_ids), len(err_ids)):
        return f"{batch.id}: request_counts {counts} for {len(out_ids)} outputs and {len(err_ids)} errors"
    return ""


def batch_once(client, cfg: Config, lines: int, cancel_share: float, hard_deadline: float) -> Callable:
    counter = iter(range(1 << 30))

    def once(rng: random.Random) -> Record:
        ids, bad_id, content = batch_file(rng, f"soak-{next(counter)}", lines, cfg.max_tokens)
        cancel = rng.random() < cancel_share
        t0 = time.monotonic()
        try:
            upload = client.files.create(file=("soak.jsonl", content), purpose="batch")
            batch = client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            batch, cancel = wait_for(client, batch.id, rng.uniform(1, 10) if cancel else None, hard_deadline)
            client.files.delete(upload.id)
            out_ids, tokens = result_ids(client, batch.output_file_id)
            err_ids, _ = result_ids(client, batch.error_file_id)
        except Exception as exc:
            return Record("batch", t0, time.monotonic(), "error", detail=_err(exc))
        problem = batch_problem(batch, ids, bad_id, out_ids, err_ids, cancel)
        return Record("batch", t0, time.monotonic(), "error" if problem else "complete", tokens, problem)

    return once
