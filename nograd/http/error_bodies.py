"""Which HTTP status each failure earns, its headers, and the error bodies: V2's
``{"error": "..."}`` and OpenAI's; no HTTP framework, so a front process answers with them too.

A failure's status is its kind's (``nograd.serving.errors.Kind.status``): a client mistake is
always a 4xx that names the problem; a 5xx means nograd or the model failed, or a refusal that
passes (503, with Retry-After).
"""

from __future__ import annotations

from typing import Final

import orjson

from nograd.serving.errors import RETRY_AFTER_S, kind_of, retry_after_s

UNEXPECTED: Final = "internal error; the server's log has the details"
"""A failure nograd did not name: the client gets no server internals (paths, types, text)."""


def status_of(exc: BaseException) -> int:
    """The status of a failure: one the front's own parsing carries (OpenAI's), else its kind's."""
    carried = getattr(exc, "status", None)
    if isinstance(carried, int) and 400 <= carried <= 599:
        return carried
    return kind_of(exc).status


def error_headers(status: int, exc: BaseException | None = None) -> list[tuple[str, str]]:
    """A 503 says when to come back: every cause of one (not ready, overloaded) is transient;
    an overloaded queue says when it expects room."""
    if status != 503:
        return []
    return [("Retry-After", str(RETRY_AFTER_S if exc is None else retry_after_s(exc)))]


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
