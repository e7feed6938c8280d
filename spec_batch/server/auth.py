"""Bearer-key auth (SPEC_BATCH_API_KEYS / SPEC_BATCH_API_KEYS_FILE). A key's files and batches are stored under its
owner hash, never under the key; without keys every caller is the anonymous owner ``None`` and sees everything.

Routes take the caller's owner with ``owner: Owner`` (a FastAPI dependency); /health and /metrics do not.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request

from spec_batch.server.errors import unauthorized

_BEARER = "bearer "


def owner_hash(key: str) -> str:
    """What files and jobs record as their owner: one-way, so a leaked database row gives no key."""
    return "key-sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyRing:
    """The configured keys, compared in constant time; empty means auth is off."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._hashes = {owner_hash(k) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def owner_of(self, authorization: str | None) -> str | None:
        """The owner of a request's ``Authorization`` header; raises a 401 APIError when keys are on and it does not
        carry one of them."""
        if not self.enabled:
            return None
        if not authorization or not authorization.lower().startswith(_BEARER):
            raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        given = owner_hash(authorization[len(_BEARER) :].strip())
        if not any(hmac.compare_digest(given, known) for known in self._hashes):
            raise unauthorized("Incorrect API key provided.")
        return given


def caller(request: Request) -> str | None:
    """FastAPI dependency: the caller's owner hash (None when auth is off). The app keeps its KeyRing at
    ``app.state.keys``."""
    keys: KeyRing = request.app.state.keys
    return keys.owner_of(request.headers.get("authorization"))


Owner = Annotated[str | None, Depends(caller)]
