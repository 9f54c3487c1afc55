"""Which status each failure earns, and the V2 error body ``{"error": "..."}``.

A client mistake is always a 4xx that names the problem; a 5xx means nograd or the model failed.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nograd.batching import BatcherClosed, DeadlineExceeded, QueueFull, SampleTooLarge
from nograd.protocol.v2 import DecodeError
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


def error_headers(status: int) -> list[tuple[str, str]]:
    """A 503 says when to come back: every cause of one (not ready, queue full) is transient."""
    return [("Retry-After", RETRY_AFTER_S)] if status == 503 else []


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def error_response(status: int, message: str) -> Response:
    return Response(
        error_body(message),
        status_code=status,
        headers=dict(error_headers(status)),
        media_type="application/json",
    )


def install_error_handlers(app: FastAPI) -> None:
    async def on_known(request: Request, exc: Exception) -> Response:
        del request
        return error_response(status_of(exc), str(exc))

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
