"""Batch-file lines for the job tests: OpenAI batch input lines and a file of them."""

from __future__ import annotations

import json
from pathlib import Path


def chat_line(cid: str, content: str, **body) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body},
        }
    )


def completion_line(cid: str, prompt, **body) -> str:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}
    )


def write_batch(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
