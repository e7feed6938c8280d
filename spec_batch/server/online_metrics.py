"""Prometheus metrics of the server: GET /metrics (no auth: it holds no user data), with the workers' metric names
(spec_batch.workers.metrics, reused as is): each online request counts in ``spec_batch_requests_in_progress``
while it decodes and, once done, in the request and token counters and histograms like a stored batch row.

When PROMETHEUS_MULTIPROC_DIR is set (several server processes) the scrape adds up every process's values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from spec_batch.core.outputs import GenerationResult
from spec_batch.workers.metrics import MULTIPROC_DIR_ENV, ChunkMetrics

router = APIRouter()


class RequestMetrics:
    """One online request's n rows: in progress from the start, counted once each result is in (`record`)."""

    def __init__(self, served: Any, n: int) -> None:
        self._chunk: ChunkMetrics | None = ChunkMetrics(target=served.target, drafter=served.drafter, n=n)

    def record(self, results: Sequence[GenerationResult | None]) -> None:
        """Counts the finished rows (a cancelled one only stops counting as in progress). Once per request."""
        if self._chunk is None:
            return
        for result in results:
            if result is None or result.finish_reason == "cancelled":
                continue
            self._chunk.on_stored("failed" if result.finish_reason == "error" else "completed", result.stats)
        self.close()

    def close(self) -> None:
        if self._chunk is not None:
            self._chunk.close()
            self._chunk = None


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

    registry = REGISTRY
    if os.environ.get(MULTIPROC_DIR_ENV):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
