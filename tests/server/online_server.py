"""The `spec-batch serve` process of the online tests: the default model with the n-gram drafter and one API key
(KEY), one torch thread (bench.serve_process.ServeProcess does the rest)."""

from __future__ import annotations

import os
from pathlib import Path

from bench.processes import SPEC_BATCH
from bench.serve_process import ServeProcess

KEY = "sk-online-test"
__all__ = ["KEY", "SPEC_BATCH", "start_server"]


def start_server(tmp: Path, *args: str, keys: str = KEY) -> ServeProcess:
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return ServeProcess(tmp, "--target", "default", "--draft", "ngram", *args, keys=keys, env=env).start()
