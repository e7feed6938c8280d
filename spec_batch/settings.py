"""Configuration from the environment. Config flows one way: environment -> Settings -> explicit arguments.

The decoding core never reads the environment; only the CLI, the runner's callers and the workers do, here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from platformdirs import user_cache_dir

DEFAULT_DATABASE_URL = "sqlite:///spec_batch.db"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_LEASE_SECONDS = 300
# Queue (workers/, README.md, "The queue"). A chunk runs at most the hard limit; the broker's visibility
# timeout is set longer than that (see workers/celery_app.py).
DEFAULT_TASK_SOFT_TIME_LIMIT = 3600
DEFAULT_CHUNK_SIZE = 32
DEFAULT_MAX_ATTEMPTS = 3
# The longest batch line read (bytes, without its newline); a longer one fails alone before it is parsed, and only
# its start is stored. 1 MiB holds a prompt of ~250k tokens of text, beyond the context of any model served here
# (and of 128k-token models), plus tool and JSON schemas; a line over it cannot run, so reading it whole buys
# nothing and costs memory and time (docs/batch-format.md).
DEFAULT_MAX_LINE_BYTES = 1 << 20
DEFAULT_API_PORT = 8000
# Uploaded batch files (POST /v1/files): OpenAI's own limits, 200 MB and 50,000 requests a file.
DEFAULT_API_MAX_FILE_BYTES = 200_000_000
DEFAULT_API_MAX_FILE_LINES = 50_000
DEFAULT_STALE_VALIDATING_S = 3600  # an hour: a 50,000-line file validates in seconds
API_RUNNERS = ("local", "queue")


class SettingsError(ValueError):
    """A SPEC_BATCH_* variable holds a value that is no choice; the message names the variable and the value."""


@dataclass(frozen=True)
class Settings:
    database_url: str
    broker_url: str
    cache_dir: Path
    lease_seconds: int
    default_target: str
    default_draft: str
    # Queue settings (defaults keep Settings(...) constructible with the fields above only).
    result_backend: str | None = None  # Celery results are not needed (state is in SQL); optional for flower
    task_soft_time_limit: int = DEFAULT_TASK_SOFT_TIME_LIMIT  # a chunk is stopped (and re-queued) after this
    task_time_limit: int = DEFAULT_TASK_SOFT_TIME_LIMIT + 300  # the pool child is killed after this
    chunk_size: int = DEFAULT_CHUNK_SIZE  # requests per task (spec-batch submit --chunk-size)
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # a request whose worker was lost this many times fails
    torch_threads: int | None = None  # per worker process; None: all cores / concurrency
    device: str | None = None  # workers' device (cpu, cuda, cuda:1); None: cuda when available, else cpu
    # Decoder options of queue workers (load_decoder's num_draft_tokens / adaptive).
    num_draft_tokens: int | None = None  # None: the drafter's default (16 for suffix, 8 otherwise)
    adaptive: bool = True  # False: always draft num_draft_tokens (deterministic statistics)
    # Weight storage of targets and draft models (loading/weights.py): full | int8 | int4 | w4a8 | auto. A target's
    # auto is w4a8 on the CPU where the native kernels build, else full (weights.auto_weights); a draft model's auto
    # is full and a draft head's int8 on the CPU (loading/heads.py head_weights).
    weights: str = "auto"
    draft_weights: str = "auto"
    tree_width: int | None = None  # a head's draft trees at batch 1 (load_decoder's tree_width); None: its default
    metrics_port: int | None = None  # workers serve Prometheus metrics on this port (workers/metrics.py); None: off
    metrics_host: str = "127.0.0.1"  # the address /metrics binds to: this machine only unless set (0.0.0.0: all)
    # The suffix drafter's job memory: tokens of a job's outputs kept per job, and jobs a worker keeps memories of.
    suffix_memory_tokens: int = 50_000
    suffix_memory_jobs: int = 4
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # batch lines longer than this fail alone, unread
    # CPU: compile the native kernels (loading/kernels/) on first use: auto (where a C++ compiler is found) | on | off
    compile: str = "auto"
    # CPU: the forward of Llama-family models: auto (ours where it applies, loading/llama_forward.py) | own | hf
    forward: str = "auto"
    pack_weights: bool = True  # CPU: prepack full-precision linears for oneDNN at load (loading/cpu_linear.py)
    huge_pages: bool = True  # CPU, Linux: weights moved onto transparent huge pages at load (loading/huge_pages.py)
    adapt_threads: bool = True  # CPU, Linux, our forward: a step's threads follow the CPUs others leave free
    # The OpenAI-compatible server (spec-batch serve, docs/server.md).
    api_host: str = "127.0.0.1"  # this machine only unless set (the compose api service sets 0.0.0.0 and keys)
    api_port: int = DEFAULT_API_PORT
    api_runner: str = "local"  # where batches run: local (in the server process) | queue (Celery workers)
    # The server's draft policy: no row's expected tokens/s below plain decoding's by more than this share (a row
    # that drafts little beside rows that draft much; core/policy.py). None ("off"): tokens/s alone, as jobs run.
    latency_slack: float | None = 0.1
    api_keys: tuple[str, ...] = ()  # bearer keys; empty: no auth (only sensible on 127.0.0.1)
    api_max_file_bytes: int = DEFAULT_API_MAX_FILE_BYTES  # a larger upload is refused with a 413
    api_max_file_lines: int = DEFAULT_API_MAX_FILE_LINES  # a file with more lines is refused with a 413
    api_docs: bool = False  # /docs, /redoc and /openapi.json: off unless asked (SPEC_BATCH_API_DOCS=1)
    # Files and batches (jobs) older than this many days are deleted by `spec-batch db prune` and, in a server,
    # once an hour (docs/batch-api.md). None: kept for ever (the default).
    retention_days: float | None = None
    # A job still validating after this many seconds was left by a process that died while validating it: a
    # server's housekeeping fails it (docs/batch-api.md). Validation stores everything in one transaction.
    stale_validating_s: int = DEFAULT_STALE_VALIDATING_S


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if value <= 0:
        raise SettingsError(f"{name}={raw!r} must be positive")
    return value


def _bool_env(name: str, default: bool) -> bool:
    raw = (os.environ.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")


def get_settings() -> Settings:
    """Reads the environment now (not at import), so tests and workers can set variables first."""
    return Settings(
        database_url=os.environ.get("SPEC_BATCH_DATABASE_URL") or DEFAULT_DATABASE_URL,
        broker_url=os.environ.get("SPEC_BATCH_BROKER_URL") or DEFAULT_BROKER_URL,
        cache_dir=Path(os.environ.get("SPEC_BATCH_CACHE") or user_cache_dir("spec-batch")),
        lease_seconds=_int_env("SPEC_BATCH_LEASE_SECONDS", DEFAULT_LEASE_SECONDS),
        default_target=os.environ.get("SPEC_BATCH_DEFAULT_TARGET") or "default",
        default_draft=os.environ.get("SPEC_BATCH_DEFAULT_DRAFT") or "suffix",
        result_backend=os.environ.get("SPEC_BATCH_RESULT_BACKEND") or None,
        task_soft_time_limit=(soft := _int_env("SPEC_BATCH_TASK_SOFT_TIME_LIMIT", DEFAULT_TASK_SOFT_TIME_LIMIT)),
        task_time_limit=max(_int_env("SPEC_BATCH_TASK_TIME_LIMIT", soft + 300), soft + 1),
        chunk_size=_int_env("SPEC_BATCH_CHUNK_SIZE", DEFAULT_CHUNK_SIZE),
        max_attempts=_int_env("SPEC_BATCH_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS),
        torch_threads=_int_env("SPEC_BATCH_TORCH_THREADS", 0) or None,
        device=os.environ.get("SPEC_BATCH_DEVICE") or None,
        num_draft_tokens=_int_env("SPEC_BATCH_NUM_DRAFT_TOKENS", 0) or None,
        adaptive=_bool_env("SPEC_BATCH_ADAPTIVE", True),
        weights=(os.environ.get("SPEC_BATCH_WEIGHTS") or "auto").strip().lower(),
        draft_weights=(os.environ.get("SPEC_BATCH_DRAFT_WEIGHTS") or "auto").strip().lower(),
        tree_width=_int_env("SPEC_BATCH_TREE_WIDTH", 0) or None,
        metrics_port=_int_env("SPEC_BATCH_METRICS_PORT", 0) or None,
        metrics_host=(os.environ.get("SPEC_BATCH_METRICS_HOST") or "").strip() or "127.0.0.1",
        suffix_memory_tokens=_int_env("SPEC_BATCH_SUFFIX_MEMORY_TOKENS", 50_000),
        suffix_memory_jobs=_int_env("SPEC_BATCH_SUFFIX_MEMORY_JOBS", 4),
        max_line_bytes=_int_env("SPEC_BATCH_MAX_LINE_BYTES", DEFAULT_MAX_LINE_BYTES),
        pack_weights=_bool_env("SPEC_BATCH_PACK_WEIGHTS", True),
        huge_pages=_bool_env("SPEC_BATCH_HUGE_PAGES", True),
        adapt_threads=_bool_env("SPEC_BATCH_ADAPT_THREADS", True),
        compile=_compile_choice(),
        forward=_choice("SPEC_BATCH_FORWARD", ("auto", "own", "hf")),
        api_host=(os.environ.get("SPEC_BATCH_API_HOST") or "").strip() or "127.0.0.1",
        api_port=_int_env("SPEC_BATCH_API_PORT", DEFAULT_API_PORT),
        api_runner=_api_runner(),
        latency_slack=_latency_slack(),
        api_keys=_api_keys(),
        api_max_file_bytes=_int_env("SPEC_BATCH_API_MAX_FILE_BYTES", DEFAULT_API_MAX_FILE_BYTES),
        api_max_file_lines=_int_env("SPEC_BATCH_API_MAX_FILE_LINES", DEFAULT_API_MAX_FILE_LINES),
        api_docs=_bool_env("SPEC_BATCH_API_DOCS", False),
        retention_days=_retention_days(),
        stale_validating_s=_int_env("SPEC_BATCH_STALE_VALIDATING_S", DEFAULT_STALE_VALIDATING_S),
    )


def _retention_days() -> float | None:
    raw = (os.environ.get("SPEC_BATCH_RETENTION_DAYS") or "").strip().lower()
    if raw in ("", "0", "off", "none"):
        return None
    try:
        days = float(raw)
    except ValueError:
        raise SettingsError(f"SPEC_BATCH_RETENTION_DAYS={raw!r} is not a number of days (0 or unset: off)") from None
    if not days > 0 or days == float("inf"):
        raise SettingsError(f"SPEC_BATCH_RETENTION_DAYS={raw!r} must be a positive number of days (0 or unset: off)")
    return days


def _latency_slack() -> float | None:
    raw = os.environ.get("SPEC_BATCH_LATENCY_SLACK") or ""
    return parse_latency_slack(raw, "SPEC_BATCH_LATENCY_SLACK") if raw.strip() else Settings.latency_slack


def parse_latency_slack(raw: str, source: str) -> float | None:
    """A latency slack as written (a share such as 0.1, or off / none); `source` names where in an error."""
    text = raw.strip().lower()
    if text in ("off", "none"):
        return None
    try:
        slack = float(text)
    except ValueError:
        raise SettingsError(f"{source}={raw!r} is not a number (a share such as 0.1, or off)") from None
    if not 0 <= slack < float("inf"):
        raise SettingsError(f"{source}={raw!r} must be a share >= 0 (or off)")
    return slack


def _compile_choice() -> str:
    return _choice("SPEC_BATCH_COMPILE", ("auto", "on", "off"))


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """An environment variable that names one of `choices` (the first when unset)."""
    raw = (os.environ.get(name) or choices[0]).strip().lower()
    if raw not in choices:
        raise SettingsError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


def _api_runner() -> str:
    runner = (os.environ.get("SPEC_BATCH_API_RUNNER") or "local").strip().lower()
    if runner not in API_RUNNERS:
        raise SettingsError(f"SPEC_BATCH_API_RUNNER={runner!r} must be one of {', '.join(API_RUNNERS)}")
    return runner


def _api_keys() -> tuple[str, ...]:
    """SPEC_BATCH_API_KEYS (comma-separated) and SPEC_BATCH_API_KEYS_FILE (one key a line; # comments), together.
    The keys themselves are never part of any message."""
    keys = [k.strip() for k in (os.environ.get("SPEC_BATCH_API_KEYS") or "").split(",")]
    path = (os.environ.get("SPEC_BATCH_API_KEYS_FILE") or "").strip()
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"SPEC_BATCH_API_KEYS_FILE={path!r} cannot be read: {type(exc).__name__}") from None
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(k for k in keys if k))


# Query parameters whose value is a secret (libpq's password=, redis' ?password=, tokens): masked when shown.
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key", re.IGNORECASE)
MASK = "***"
_MIN_FREE_TEXT_SECRET = 3  # shorter "secrets" are not masked inside free text (they would garble it)


def _is_secret(name: str) -> bool:
    return bool(_SECRET_PARAM.search(name))


def shown_url(url: str) -> str:
    """A URL as it may be printed: the password of ``user:pw@`` and secret query parameters masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    shown = url
    if parts.password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        shown = shown.replace(parts.netloc, f"{userinfo.partition(':')[0]}:{MASK}@{host}", 1)
    if parts.query:
        query = "&".join(
            f"{k}={MASK}" if sep and _is_secret(k) else f"{k}{sep}{v}"
            for k, sep, v in (p.partition("=") for p in parts.query.split("&"))
        )
        head, _, _ = shown.partition("?")
        shown = f"{head}?{query}" + (f"#{parts.fragment}" if parts.fragment else "")
    return shown


def url_secrets(url: str) -> list[str]:
    """The secrets written in a URL (the password of ``user:pw@``, the values of secret query parameters),
    raw and percent-decoded, longest first."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [parts.password] if parts.password else []
    found += [v for k, _, v in (p.partition("=") for p in parts.query.split("&")) if _is_secret(k) and v]
    found += [unquote(s) for s in found]
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, *urls: str | None) -> str:
    """`text` with each of `urls` shown masked (shown_url) and their secrets masked wherever else they appear
    (a driver's error may quote a password): for any message that may name the database or the broker."""
    for url in filter(None, urls):
        text = text.replace(url, shown_url(url))
        for secret in url_secrets(url):
            if len(secret) >= _MIN_FREE_TEXT_SECRET:
                text = text.replace(secret, MASK)
    return text
