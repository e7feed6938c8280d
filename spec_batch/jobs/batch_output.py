"""Batch files out: a job's stored rows -> OpenAI output lines (successes) and error lines (docs/batch-format.md).

Output line::

    {"id": "batch_req_12", "custom_id": "r1", "response": {"status_code": 200, "request_id": "req_12",
     "body": {"id": "chatcmpl-12", "object": "chat.completion", "created": 1700000000, "model": "<target>",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                           "logprobs": null, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50,
                        "speculative": {"drafter": "ngram", "draft_tokens": .., "accepted_tokens": .., ...}}}},
     "error": null}

Error lines: an invalid line or a cancelled request has ``"response": null`` and
``"error": {"code", "message", "param", "line"}``; a request that failed while decoding (e.g. a prompt too long
for the context) has ``"response": {"status_code": 400, "body": {"error": {"message", "type", "param", "code",
"line"}}}`` and ``"error": null``, as OpenAI's error files do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..openai_format import CHAT
from ..openai_format.render import chat_choice, completion_choice
from ..openai_format.render import usage as usage_of_stats
from ..store.models import REQ_CANCELLED
from .stats import stats_of_row

# Codes of requests that failed while decoding (response.status_code 500 for internal ones, else 400).
INTERNAL_ERROR = "internal_error"


def errors_path_for(out_path: str | Path) -> Path:
    """OUT.jsonl -> OUT.errors.jsonl beside it."""
    p = Path(out_path)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + ".errors.jsonl")


def usage(req: Any, drafter: str) -> dict[str, Any]:
    """OpenAI's usage, with the request's speculation statistics (RequestStats.to_dict) in `speculative`."""
    return usage_of_stats(stats_of_row(req).to_dict(), drafter)


def _choices(req: Any) -> list[dict[str, Any]]:
    """The row's choices in OpenAI's shape: requests.choices when stored (n > 1, logprobs), else the one output."""
    stored = req.choices or [{"text": req.output or "", "finish_reason": req.finish_reason, "logprobs": None}]
    tools = (req.options or {}).get("tools", {}).get("tool_choice", "none") != "none"
    if req.endpoint == CHAT:
        return [
            chat_choice(i, c["text"], c["finish_reason"], c["logprobs"], tools=tools, call_id=f"call_{req.id}_{i}")
            for i, c in enumerate(stored)
        ]
    return [completion_choice(i, c["text"], c["finish_reason"], c["logprobs"]) for i, c in enumerate(stored)]


def output_line(req: Any, *, model: str, drafter: str) -> dict[str, Any]:
    """The OpenAI output line of a completed request row (spec_batch.store.Request or alike)."""
    created = int(req.completed_at.timestamp()) if req.completed_at is not None else 0
    chat = req.endpoint == CHAT
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{req.id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": _choices(req),
        "usage": usage(req, drafter),
    }
    return {
        "id": f"batch_req_{req.id}",
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{req.id}", "body": body},
        "error": None,
    }


def error_line(req: Any) -> dict[str, Any]:
    """The OpenAI error-file line of a failed or cancelled request row."""
    custom_id = req.custom_id  # invalid lines keep theirs too (migration 0005)
    code = req.error_code or "error"
    if req.endpoint is None or req.status == REQ_CANCELLED:  # an invalid line, or cancelled: no HTTP response
        return {
            "id": f"batch_req_{req.id}",
            "custom_id": custom_id,
            "response": None,
            "error": {
                "code": code,
                "message": req.error or code,
                "param": getattr(req, "error_param", None),
                "line": req.line_number,
            },
        }
    status = 500 if code == INTERNAL_ERROR else 400
    return {
        "id": f"batch_req_{req.id}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"req_{req.id}",
            "body": {
                "error": {
                    "message": f"line {req.line_number}, custom_id {custom_id!r}: {req.error}",
                    "type": "server_error" if status == 500 else "invalid_request_error",
                    "param": getattr(req, "error_param", None),
                    "code": code,
                    "line": req.line_number,
                }
            },
        },
        "error": None,
    }


def write_jsonl(path: str | Path, lines: Iterable[dict[str, Any]]) -> int:
    """Writes lines atomically (a temporary file renamed over `path`). Returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)
