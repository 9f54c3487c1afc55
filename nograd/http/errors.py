"""Which status each failure earns, and the V2 error body ``{"error": "..."}``.

A client mistake is always a 4xx that names the problem; a 5xx means nograd or the model failed.
"""

from __future__ import annotations

import logging
import math
from typing import Final

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nograd.batching import BatcherClosed, DeadlineExceeded, QueueFull, SampleTooLarge
from nograd.core.errors import DecodeError
from nograd.serving.control import ControlRefused, LoadFailed
from nograd.serving.errors import (
    InferenceFailed,
    InvalidInput,
    LimitExceeded,
    ModelNotFound,
    ModelNotReady,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"

STATUS: dict[type[Exception], int] = {
    ControlRefused: 400,
    LoadFailed: 400,
    DecodeError: 400,
    InvalidInput: 400,
    LimitExceeded: 422,
    ModelNotFound: 404,
    ModelNotReady: 503,
    QueueFull: 503,
    BatcherClosed: 503,
    DeadlineExceeded: 504,
    SampleTooLarge: 507,
    InferenceFailed: 500,
}


def status_of(exc: BaseException) -> int:
    carried = getattr(exc, "status", None)
    if isinstance(carried, int) and 400 <= carried <= 599:
        return carried
    for kind, status in STATUS.items():
        if isinstance(exc, kind):
            return status
    return 500


def error_headers(status: int, exc: BaseException | None = None) -> list[tuple[str, str]]:
    """A 503 says when to come back: every cause of one (not ready, overloaded) is transient;
    an overloaded queue says when it expects room."""
    if status != 503:
        return []
    if isinstance(exc, QueueFull):
        return [("Retry-After", str(max(1, math.ceil(exc.retry_after_s))))]
    return [("Retry-After", RETRY_AFTER_S)]


def error_body(message: str) -> bytes:
    """A V2 error: ``{"error": message}``."""
    return orjson.dumps({"error": message})


_OPENAI_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}
_OPENAI_CODES: Final[dict[int, str]] = {
    404: "model_not_found",
    503: "unavailable",
    504: "timeout",
    507: "out_of_memory",
}


def openai_error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> bytes:
    """An OpenAI error, as its SDK parses it: ``{"error": {message, type, param, code}}``."""
    detail = {
        "message": message,
        "type": _OPENAI_TYPES.get(status, "server_error"),
        "param": param,
        "code": code or _OPENAI_CODES.get(status),
    }
    return orjson.dumps({"error": detail})


def error_response(
    status: int, message: str, headers: list[tuple[str, str]] | None = None
) -> Response:
    return Response(
        error_body(message),
        status_code=status,
        headers=dict(error_headers(status) if headers is None else headers),
        media_type="application/json",
    )


def install_error_handlers(app: FastAPI) -> None:
    async def on_known(request: Request, exc: Exception) -> Response:
        del request
        status = status_of(exc)
        return error_response(status, str(exc), error_headers(status, exc))

    async def on_http(request: Request, exc: Exception) -> Response:
        del request
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def on_validation(request: Request, exc: Exception) -> Response:
        del request
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        return error_response(400, f"invalid request: {problems}")

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    for kind in STATUS:
        app.add_exception_handler(kind, on_known)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_unexpected)
