"""FastAPI's exception handlers: every failure answered with its status, headers and V2 error
body (``nograd.http.error_bodies``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nograd.http.error_bodies import UNEXPECTED, error_body, error_headers, status_of
from nograd.serving.errors import KINDS

logger = logging.getLogger(__name__)


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
        return error_response(500, UNEXPECTED)

    for cause, _ in KINDS:
        app.add_exception_handler(cause, on_known)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_unexpected)
