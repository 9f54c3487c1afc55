"""What every inference call shares, whatever its protocol: request ids, deadlines from headers,
cancellation when the client goes away, the in-flight gauge, request metrics and the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
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


async def until_disconnect(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Run ``work`` in this task, cancelling it if the client disconnects first.

    After the body is read, the ASGI ``receive`` only returns again with ``http.disconnect``;
    cancelling propagates into the batcher, which drops the request's queued rows before they
    cost compute. One watcher task per call, and ``work`` runs in the caller's own task: a second
    task per request was measurable event-loop time for small models.
    """
    # The watcher reads ``receive`` too: the body must be in hand (Starlette keeps it for the
    # route's own ``request.body()``) before the watcher starts, or it could take a body chunk.
    await request.body()
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                current.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await work()
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:
            # Only the watcher cancelled this task: the client left. Anyone else's cancel
            # (server shutdown) still counts and propagates.
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
    # The scope's state dict directly: ``request.state`` builds a wrapper object per request.
    started = request.scope.get("state", {}).get(STARTED_KEY) or time.perf_counter()
    metrics = metrics_of(request)
    given = request_id_of(request)
    # 128 random bits as 32 hex digits, like uuid4().hex, without building a UUID object.
    call = Call(given or os.urandom(16).hex(), None, id_from_header=given is not None)
    metrics.inflight.inc()
    try:
        call.timeout_s = header_timeout_s(request)
        response = await until_disconnect(request, lambda: work(call))
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
    metrics.request_done(call.model, protocol, response.status_code, seconds)
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
