"""What every inference call shares, whatever its protocol: request ids, deadlines from headers,
cancellation when the client goes away, the in-flight gauge, request metrics and the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request, Response

from app.api.errors import status_of
from app.api.middleware import STARTED_KEY
from app.api.state import metrics_of
from app.api.v2_codec import DecodeError
from app.metrics import UNKNOWN_MODEL

logger = logging.getLogger("app.requests")

REQUEST_ID_HEADER = "X-Request-ID"
TIMEOUT_HEADER = "X-Request-Timeout"
CLIENT_CLOSED = 499
"""Status recorded (never sent) for a request whose client disconnected before its answer."""
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass
class Call:
    """One inference call as the routes see it."""

    request_id: str
    timeout_s: float | None
    id_from_header: bool = False
    model: str = UNKNOWN_MODEL
    """Metric label: set by the route once it knows the name is a served model."""


class ClientGone(Exception):
    """The client disconnected while its request waited; its queued work was cancelled."""


def request_id_of(request: Request) -> str | None:
    """The caller's X-Request-ID when it is a sane token (junk is never echoed)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return given if given is not None and _SAFE_ID.match(given) else None


def adopt_request_id(call: Call, protocol_id: str | None) -> None:
    """Use the protocol's own id (the V2 ``id``) when the caller sent no X-Request-ID."""
    if not call.id_from_header and protocol_id is not None and _SAFE_ID.match(protocol_id):
        call.request_id = protocol_id


def header_timeout_s(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise DecodeError(
            f"header {TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}"
        )
    return value


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``, cancelling it if the client disconnects first.

    After the body is read, the ASGI ``receive`` only returns again with ``http.disconnect``;
    cancelling the route's task propagates into the batcher, which drops the request's queued
    rows before they cost compute.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone("client disconnected") from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


async def run_call(
    request: Request,
    protocol: str,
    work: Callable[[Call], Awaitable[Response]],
    on_error: Callable[[int, Exception], Response],
) -> Response:
    """Run one inference call with everything every protocol owes its callers."""
    started = getattr(request.state, STARTED_KEY, None) or time.perf_counter()
    metrics = metrics_of(request)
    given = request_id_of(request)
    call = Call(given or uuid.uuid4().hex, None, id_from_header=given is not None)
    metrics.inflight.inc()
    try:
        call.timeout_s = header_timeout_s(request)
        response = await until_disconnect(request, work(call))
    except ClientGone:
        response = Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        status = status_of(exc)
        if status >= 500 and status not in (503, 504, 507):
            logger.exception("%s call on model %s failed", protocol, call.model)
        response = on_error(status, exc)
    finally:
        metrics.inflight.dec()
    seconds = time.perf_counter() - started
    response.headers[REQUEST_ID_HEADER] = call.request_id
    metrics.requests.labels(call.model, protocol, str(response.status_code)).inc()
    metrics.request_duration.labels(call.model, protocol).observe(seconds)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "%s %s -> %d in %.1f ms",
            request.method,
            request.url.path,
            response.status_code,
            seconds * 1000,
            extra={
                "request_id": call.request_id,
                "model": call.model,
                "protocol": protocol,
                "status": response.status_code,
                "duration_ms": round(seconds * 1000, 3),
            },
        )
    return response
