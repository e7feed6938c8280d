"""What `spec-batch serve` serves: one target and drafter pair at one precision, named as jobs and queues name them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedModel:
    model_id: str  # what /v1/models lists and a request's `model` must name (or "default")
    target: str  # as stored on a job: the queue of the pair is workers.routing.queue_name(target, drafter, ...)
    drafter: str
    weights: str | None = None  # None: full weights
    dtype: str | None = None  # None: the worker's default dtype

    def names(self, model: str) -> bool:
        return model in (self.model_id, "default")
