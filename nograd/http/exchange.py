"""What every inference call shares, whatever its protocol: request ids, deadlines from headers,
cancellation when the client goes away, the in-flight gauge, request metrics and the log line.

Inference calls are served straight from ASGI (``nograd.http.direct``): an ``Incoming`` decodes the
headers once and reads the body once, and a ``Reply`` goes out as the two ASGI messages.
Starlette's ``Request`` and ``Response`` objects (a header wrapper built per lookup, a header list
rebuilt per response) and a watcher task per call were a large share of a small model's CPU per
call (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from nograd.core.errors import DecodeError
from nograd.http.errors import status_of
from nograd.http.middleware import STARTED_KEY
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics

logger = logging.getLogger("nograd.requests")

REQUEST_ID_HEADER = "X-Request-ID"
TIMEOUT_HEADER = "X-Request-Timeout"
CLIENT_CLOSED = 499
"""Status recorded (never sent) for a request whose client disconnected before its answer."""
DISCONNECT_GRACE_S = 0.02
"""How long a call runs before a task starts watching for its client leaving.

A watcher task per call (create, schedule, cancel, collect) costs a noticeable share of a small
model's call; most calls are answered well within this, and one whose client
leaves later is still cancelled before its queued rows cost compute. A client that leaves sooner
is noticed at this mark: at most this much queueing is spent on it.
"""
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


class Incoming:
    """One request as ASGI hands it over: header names are lower case (ASGI's rule), and a name
    sent twice keeps its first value, as Starlette's ``Headers.get`` does."""

    __slots__ = ("_body", "headers", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.headers: dict[str, str] = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in reversed(scope["headers"])
        }
        self._body: bytes | None = None

    async def body(self) -> bytes:
        """The whole body, read once; a client that disconnects before sending it is gone."""
        if self._body is None:
            chunks: list[bytes] = []
            while True:
                message = await self.receive()
                if message["type"] != "http.request":
                    raise ClientGone("client disconnected before sending its body")
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return self._body


@dataclass
class Reply:
    """A whole answer; sent as two ASGI messages, or as a Starlette ``Response`` by a route."""

    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)

    async def send(self, send: Send) -> None:
        raw = [(b"content-length", str(len(self.body)).encode())]
        if self.content_type is not None:
            raw.append((b"content-type", self.content_type.encode("latin-1")))
        raw.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers)
        await send({"type": "http.response.start", "status": self.status, "headers": raw})
        await send({"type": "http.response.body", "body": self.body})

    def response(self) -> Response:
        return Response(
            self.body,
            status_code=self.status,
            headers=dict(self.headers),
            media_type=self.content_type,
        )


def request_id_of(incoming: Incoming) -> str | None:
    """The caller's X-Request-ID when it is a sane token (junk is never echoed)."""
    given = incoming.headers.get(REQUEST_ID_HEADER.lower())
    return given if given is not None and _SAFE_ID.match(given) else None


def adopt_request_id(call: Call, protocol_id: str | None) -> None:
    """Use the protocol's own id (the V2 ``id``) when the caller sent no X-Request-ID."""
    if not call.id_from_header and protocol_id is not None and _SAFE_ID.match(protocol_id):
        call.request_id = protocol_id


def header_timeout_s(incoming: Incoming) -> float | None:
    raw = incoming.headers.get(TIMEOUT_HEADER.lower())
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


async def until_disconnect(
    receive: Receive, work: Callable[[], Awaitable[Reply]], grace_s: float = DISCONNECT_GRACE_S
) -> Reply:
    """Run ``work`` in this task, cancelling it if the client disconnects first.

    Call only once the body is read: after it, the ASGI ``receive`` returns again only with
    ``http.disconnect``, and a watcher reading it earlier could take a body chunk. Cancelling
    propagates into the batcher, which drops the request's queued rows before they cost compute.
    ``work`` runs in the caller's own task, and the watcher task starts only once the call has
    run ``grace_s`` (see ``DISCONNECT_GRACE_S``).
    """
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    assert current is not None
    gone = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
                current.cancel()
                return

    def start_watching() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(grace_s, start_watching) if grace_s > 0 else None
    if timer is None:
        start_watching()
    try:
        return await work()
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:
            # Only the watcher cancelled this task: the client left. Anyone else's cancel
            # (server shutdown) still counts and propagates.
            raise ClientGone("client disconnected") from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher


async def run_call(
    incoming: Incoming,
    metrics: Metrics,
    protocol: str,
    work: Callable[[Call], Awaitable[Reply]],
    on_error: Callable[[int, Exception], Reply],
) -> Reply:
    """Run one inference call with everything every protocol owes its callers."""
    started = incoming.scope.get("state", {}).get(STARTED_KEY) or time.perf_counter()
    given = request_id_of(incoming)
    # 128 random bits as 32 hex digits, like uuid4().hex, without building a UUID object.
    call = Call(given or os.urandom(16).hex(), None, id_from_header=given is not None)
    metrics.inflight.inc()
    try:
        call.timeout_s = header_timeout_s(incoming)
        await incoming.body()
        reply = await until_disconnect(incoming.receive, lambda: work(call))
    except ClientGone:
        reply = Reply(CLIENT_CLOSED, content_type=None)
    except Exception as exc:
        status = status_of(exc)
        if status >= 500 and status not in (503, 504, 507):
            logger.exception("%s call on model %s failed", protocol, call.model)
        reply = on_error(status, exc)
    finally:
        metrics.inflight.dec()
    seconds = time.perf_counter() - started
    reply.headers.append((REQUEST_ID_HEADER, call.request_id))
    metrics.request_done(call.model, protocol, reply.status, seconds)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "%s %s -> %d in %.1f ms",
            incoming.scope["method"],
            incoming.scope["path"],
            reply.status,
            seconds * 1000,
            extra={
                "request_id": call.request_id,
                "model": call.model,
                "protocol": protocol,
                "status": reply.status,
                "duration_ms": round(seconds * 1000, 3),
            },
        )
    return reply
