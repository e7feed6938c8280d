"""Routing: a job's target and drafter decide its Celery queue, so one fleet can serve several models.

A worker listens on the queues of the (target, drafter) pairs it serves (``spec-batch worker --model
TARGET:DRAFTER``, or explicit ``--queues``); ``spec-batch submit`` publishes every chunk of a job to the
queue of the job's pair. Queue names are plain ASCII (Redis keys, flower, ``celery inspect``)::

    queue_name("default", "ngram")                    -> "spec-batch.default.ngram"
    queue_name("HuggingFaceTB/SmolLM2-360M", "none")  -> "spec-batch.huggingfacetb_smollm2-360m.none-3f9c2a1b"

Characters outside ``[a-z0-9_-]`` become ``_`` (dots too: a dot separates target from drafter); when that
changes the name, or the name is longer than the limit, a short hash of the exact pair is appended so two
different pairs never share a queue.

A queue name given by hand (``submit --queue``, ``worker --queues``) must be 1 to 120 characters of
``[A-Za-z0-9._:-]`` (:func:`check_queue_name`): no spaces, slashes or other characters that Redis keys, the
shell and ``celery inspect`` treat specially. Derived names always are.
"""

from __future__ import annotations

import hashlib
import re

QUEUE_PREFIX = "spec-batch"
MAX_QUEUE_NAME = 120  # jobs.queue is String(128)
_UNSAFE = re.compile(r"[^a-z0-9_-]+")
_QUEUE_NAME = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_QUEUE_NAME}}}")


class QueueNameError(ValueError):
    """A queue name outside the allowed characters or length."""


def check_queue_name(name: str) -> str:
    """name, when it is a valid queue name (module docstring); else QueueNameError saying what is allowed."""
    if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
        raise QueueNameError(
            f"queue name {name!r} is not allowed: use 1 to {MAX_QUEUE_NAME} characters among letters, digits "
            f"and . _ : - (no spaces or slashes)"
        )
    return name


def _part(value: str) -> str:
    return _UNSAFE.sub("_", value.strip().lower()).strip("_") or "_"


def precision_part(weights: str | None, dtype: str | None) -> str | None:
    """The queue name's precision part: None for full weights at the worker's default dtype (today's names),
    else e.g. "int4-bfloat16" or "full-float32", so chunks of one job never run at mixed precisions."""
    if (weights or "full") == "full" and not dtype:
        return None
    return f"{weights or 'full'}-{dtype or 'default'}"


def queue_name(target: str, drafter: str, weights: str | None = None, dtype: str | None = None) -> str:
    """The queue of jobs whose target is `target` and whose drafter is `drafter` (as stored on the job), at the
    job's precision (weights, dtype; None, None: full weights at the worker's default dtype)."""
    if not target or not drafter:
        raise ValueError(f"queue_name needs a target and a drafter, got {target!r}, {drafter!r}")
    t, d = _part(target), _part(drafter)
    name = f"{QUEUE_PREFIX}.{t}.{d}"
    precision = precision_part(weights, dtype)
    if precision is not None:
        name = f"{name}.{_part(precision)}"
    lossless = t == target and d == drafter
    if lossless and len(name) <= MAX_QUEUE_NAME:
        return name
    exact = f"{target}\0{drafter}" + (f"\0{precision}" if precision is not None else "")  # today's digests kept
    digest = hashlib.sha256(exact.encode()).hexdigest()[:8]
    room = MAX_QUEUE_NAME - len(digest) - 1
    return f"{name[:room]}-{digest}"


def parse_model_pair(value: str, default_drafter: str = "suffix") -> tuple[str, str]:
    """``TARGET[:DRAFTER]`` as given to ``spec-batch worker --model``: the FIRST ':' splits, since drafter names
    carry colons of their own (``default:self:int4``, ``default:head:notices``, ``default:hybrid:/heads/x``) and
    a worker must listen where ``submit`` publishes for the same pair; ``./models/big:HuggingFaceTB/SmolLM2-135M``
    splits the same way. No ':' means the default drafter."""
    value = value.strip()
    head, sep, tail = value.partition(":")
    if not sep:
        head, tail = value, default_drafter
    if not head.strip() or not tail.strip():
        raise ValueError(f"--model {value!r}: expected TARGET[:DRAFTER], e.g. default:ngram")
    return head.strip(), tail.strip()


__all__ = ["QUEUE_PREFIX", "QueueNameError", "check_queue_name", "parse_model_pair", "precision_part", "queue_name"]
