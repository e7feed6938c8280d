"""A request-body limit for the whole app (an ASGI middleware): a body over the limit is a 413 in OpenAI's error
shape, refused from its Content-Length when it says so, else as soon as the bytes read pass the limit (a chunked
body), so no handler ever holds more than the limit in memory.

Routes that stream a large body to storage with their own limit (``POST /v1/files``) are exempt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from spec_batch.server.errors import APIError, error_response, too_large

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: a chat request with long messages, tools and schemas fits many times
EXEMPT = (("POST", "/v1/files"),)  # (method, path): streamed uploads with their own limit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        exempt: tuple[tuple[str, str], ...] = EXEMPT,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"].rstrip("/")) in self.exempt:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)  # the 413 in OpenAI's body, before reading
            return
        seen = 0

        async def counted() -> Message:
            # raised where the handler reads its body: the app's APIError handler answers the 413
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, counted, send)

    def _error(self) -> APIError:
        return too_large(f"The request body is larger than the limit of {self.max_bytes} bytes.")
