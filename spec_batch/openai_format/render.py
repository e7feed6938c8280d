"""Response bodies' choices in OpenAI's shape, from results (batch output lines now, the online server too).

A choice is {"text", "finish_reason", "logprobs"}; "logprobs" is None or a list of token records
{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]} (chat's shape), made once from the
core's TokenLogprob list with the tokenizer (`token_records`), and turned into the completions shape here.
"""

from __future__ import annotations

import json
from typing import Any

from .tools import parse_calls


def _token(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([int(token_id)])
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def token_records(tokenizer: Any, logprobs: Any) -> list[dict[str, Any]] | None:
    """GenerationResult.logprobs (TokenLogprob(token_id, logprob, top)) -> chat's logprobs.content records."""
    if logprobs is None:
        return None
    return [
        {**_token(tokenizer, t.token_id, t.logprob), "top_logprobs": [_token(tokenizer, tid, lp) for tid, lp in t.top]}
        for t in logprobs
    ]


def chat_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    records: list[dict[str, Any]] | None,
    *,
    tools: bool = False,
    call_id: str = "call",
) -> dict[str, Any]:
    """One chat.completion choice; with tools, an answer that is a call becomes message.tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools:
        _, calls, _ = parse_calls(text)
        if calls:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"{call_id}_{k}",
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)},
                    }
                    for k, c in enumerate(calls)
                ],
            }
            finish_reason = "tool_calls"
    return {
        "index": index,
        "message": message,
        "logprobs": None if records is None else {"content": records, "refusal": None},
        "finish_reason": finish_reason,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, records: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One text_completion choice; logprobs in the legacy shape {tokens, token_logprobs, top_logprobs, text_offset}."""
    logprobs = None
    if records is not None:
        offsets, at = [], 0
        for r in records:
            offsets.append(at)
            at += len(r["token"])
        logprobs = {
            "tokens": [r["token"] for r in records],
            "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{t["token"]: t["logprob"] for t in r["top_logprobs"]} for r in records],
            "text_offset": offsets,
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# Statistics that are not per-request speculation figures: the token counts are usage's own, and the per-position
# counts are the job report's.
NOT_SPECULATIVE = ("prompt_tokens", "output_tokens", "drafted_per_position", "accepted_per_position")


def usage(stats: dict[str, Any], drafter: str) -> dict[str, Any]:
    """OpenAI's usage from a request's statistics (RequestStats.to_dict), with the speculation figures in
    `speculative` (batch output lines and online responses alike)."""
    speculative = {"drafter": drafter, **{k: v for k, v in stats.items() if k not in NOT_SPECULATIVE}}
    return {
        "prompt_tokens": stats["prompt_tokens"],
        "completion_tokens": stats["output_tokens"],
        "total_tokens": stats["prompt_tokens"] + stats["output_tokens"],
        "speculative": speculative,
    }
