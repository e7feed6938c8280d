"""Configuration from the environment. Config flows one way: environment -> Settings -> explicit arguments.

The decoding core never reads the environment; only the CLI, the runner's callers and the workers do, here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir

DEFAULT_DATABASE_URL = "sqlite:///spec_batch.db"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_LEASE_SECONDS = 300


@dataclass(frozen=True)
class Settings:
    database_url: str
    broker_url: str
    cache_dir: Path
    lease_seconds: int
    default_target: str
    default_draft: str


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def get_settings() -> Settings:
    """Reads the environment now (not at import), so tests and workers can set variables first."""
    return Settings(
        database_url=os.environ.get("SPEC_BATCH_DATABASE_URL") or DEFAULT_DATABASE_URL,
        broker_url=os.environ.get("SPEC_BATCH_BROKER_URL") or DEFAULT_BROKER_URL,
        cache_dir=Path(os.environ.get("SPEC_BATCH_CACHE") or user_cache_dir("spec-batch")),
        lease_seconds=_int_env("SPEC_BATCH_LEASE_SECONDS", DEFAULT_LEASE_SECONDS),
        default_target=os.environ.get("SPEC_BATCH_DEFAULT_TARGET") or "default",
        default_draft=os.environ.get("SPEC_BATCH_DEFAULT_DRAFT") or "ngram",
    )
