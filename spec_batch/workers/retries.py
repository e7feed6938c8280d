"""When a chunk's task retries: which failures are transient (the database or broker away), and the backoff."""

from __future__ import annotations

import random

MAX_RETRIES = 10
RETRY_BACKOFF_MAX_S = 60


def retry_delay(retries: int) -> float:
    """Exponential backoff with jitter: about 2**retries seconds (at most RETRY_BACKOFF_MAX_S), 50-100% of it."""
    return min(RETRY_BACKOFF_MAX_S, 2**retries) * (0.5 + random.random() / 2)


def is_transient(exc: BaseException) -> bool:
    """A failure that may go away by itself: a lost database or broker connection, a locked SQLite file."""
    try:
        import sqlalchemy.exc as sa_exc
    except ImportError:  # pragma: no cover
        sa_exc = None
    if sa_exc is not None:
        if isinstance(exc, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):
            return True
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return True
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
            text = str(exc).lower()
            permanent = ("no such table", "no such column", "does not exist", "syntax error", "permission denied")
            return not any(p in text for p in permanent)
    try:
        import kombu.exceptions
        import redis.exceptions

        if isinstance(
            exc, (kombu.exceptions.OperationalError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        ):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, (ConnectionError, TimeoutError))
