"""Errors in OpenAI's body (``{"error": {"message", "type", "param", "code"}}``) with the right HTTP status, so the
official clients raise their usual exception classes (BadRequestError, AuthenticationError, NotFoundError, ...).

Handlers never echo a traceback, a request header or a key: an unexpected exception is a 500 with a fixed text
(its type and message go to the server's log only).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's own type for a bad key, with code invalid_api_key
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error a client gets back as OpenAI's error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


INTERNAL_MESSAGE = "The server had an error while processing your request."


def internal_error() -> APIError:
    """The one 500 a client sees: a fixed text (what went wrong goes to the server's log only)."""
    return APIError(500, INTERNAL_MESSAGE, code="internal_error")


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(kind: str, ident: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """404 for an object that does not exist and for one owned by another key alike (no existence leak)."""
    return APIError(404, f"No {kind} with id '{ident}' found.", param=param, code=code)


def model_not_found(model: str, served: str) -> APIError:
    also = "" if served == "default" else " (also called 'default')"
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'{also}.",
        param="model",
        code="model_not_found",
    )


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def too_large(message: str, *, param: str | None = None) -> APIError:
    return APIError(413, message, param=param, code="request_too_large")


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    return error_response(APIError(exc.status_code, message))


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(where) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    return error_response(invalid_request(message, param=param, code="invalid_value"))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected server error: %s: %s", type(exc).__name__, exc)
    return error_response(internal_error())


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
