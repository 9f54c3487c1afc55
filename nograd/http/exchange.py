"""An HTTP inference call around the serving core's call lifecycle
(``nograd.serving.calls.lifecycle``): request ids and deadlines from headers, the body read once,
cancellation when the client goes away, and the failure's kind answered as an HTTP status.

Inference calls are served straight from ASGI (``nograd.http.direct``): an ``Incoming`` decodes the
headers once and reads the body once, and a ``Reply`` goes out as the two ASGI messages.
Starlette's ``Request`` and ``Response`` objects (a header wrapper built per lookup, a header list
rebuilt per response) and a watcher task per call were a large share of a small model's CPU per
call (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Receive, Scope

from nograd.core.errors import DecodeError
from nograd.http.connections import STARTED_KEY
from nograd.http.error_bodies import status_of
from nograd.http.headers import REQUEST_ID_HEADER, TIMEOUT_HEADER, TRACE_PARENT_HEADER
from nograd.http.reply import Reply, encoded
from nograd.protocol.compression import (
    MOST_RATIO,
    PIECE_BYTES,
    Inflater,
    request_encoding,
    too_large,
)
from nograd.protocol.limits import OFFLOAD_DECODE_BYTES, decoded_too_large, json_decoded_bytes
from nograd.serving.calls.lifecycle import CLIENT_GONE, Call, Calls, safe_request_id

Body = bytes | bytearray | memoryview
Parsed = TypeVar("Parsed")
DISCONNECT_GRACE_S = 0.02
"""How long a call runs before a task starts watching for its client leaving.

A watcher task per call (create, schedule, cancel, collect) costs a noticeable share of a small
model's call; most calls are answered well within this, and one whose client
leaves later is still cancelled before its queued rows cost compute. A client that leaves sooner
is noticed at this mark: at most this much queueing is spent on it.
"""


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
        self._body: bytes | bytearray | None = None

    async def body(self) -> bytes | bytearray:
        """The whole body, read once; a client that disconnects before sending it is gone. A
        body of several pieces is gathered into one buffer as they arrive, never held twice
        (the buffer grows in place), and is writable: binary tensors become views of it."""
        if self._body is None:
            message = await self._next()
            body: bytes | bytearray = message.get("body", b"")
            if message.get("more_body", False):
                gathered = bytearray(body)
                while message.get("more_body", False):
                    message = await self._next()
                    gathered += message.get("body", b"")
                body = gathered
            self._body = body
        return self._body

    async def _next(self) -> Message:
        message = await self.receive()
        if message["type"] != "http.request":
            raise ClientGone("client disconnected before sending its body")
        return message


def caller_of(calls: Calls, scope: Scope) -> str:
    """Whose call this is (``Calls.caller``: the id of the API key it carries), for the state a
    caller owns (shared-memory regions)."""
    return calls.caller([v for k, v in scope["headers"] if k == b"authorization"])


def header_timeout_s(raw: str | None) -> float | None:
    """The seconds an ``X-Request-Timeout`` header's value gives the call (None: no header)."""
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


async def parse_measured(
    calls: Calls, call: Call, text: Body, parse: Callable[[Body], Parsed]
) -> Parsed:
    """``parse(text)``, a JSON document, once the memory decoding it takes is estimated
    (``json_decoded_bytes``) and held (``hold_decoded``). A large document is measured and
    parsed in a thread."""
    limit = calls.plane.settings.max_decoded_bytes
    offload = len(text) > OFFLOAD_DECODE_BYTES
    if offload:
        size = await run_in_threadpool(json_decoded_bytes, text, limit)
    else:
        size = json_decoded_bytes(text, limit)
    hold_decoded(calls, call, size)
    return await run_in_threadpool(parse, text) if offload else parse(text)


def hold_decoded(calls: Calls, call: Call, size: int) -> None:
    """The ``size`` bytes decoding a request's JSON takes, within ``NOGRAD_MAX_DECODED_BYTES``
    (else 422, before parsing) and held in the process's budget for ``call`` (else 503)."""
    limit = calls.plane.settings.max_decoded_bytes
    if size > limit:
        calls.metrics.rejected.labels(call.model, "too_large").inc()
        raise decoded_too_large(size, limit, "the request's JSON")
    calls.hold_bytes(call, size)


async def inflated_body(incoming: Incoming, calls: Calls, call: Call) -> bytes | bytearray:
    """The request's body, inflated when its ``Content-Encoding`` is gzip or deflate: a piece at
    a time, each counted against ``NOGRAD_MAX_REQUEST_BYTES`` (413 past it, after at most that
    much output) and held in the process's budget for ``call`` (503 when it does not fit). A body
    that may inflate past one piece is inflated in a thread, a piece per hop."""
    body = await incoming.body()
    encoding = request_encoding(incoming.headers.get("content-encoding"))
    if encoding is None:
        return body
    limit = calls.plane.settings.max_request_bytes
    inflater = Inflater(body, encoding)
    offload = len(body) * MOST_RATIO > PIECE_BYTES
    whole = bytearray()
    while not inflater.done:
        piece = await run_in_threadpool(inflater.step) if offload else inflater.step()
        if len(whole) + len(piece) > limit:
            calls.metrics.rejected.labels(call.model, "too_large").inc()
            raise too_large(limit)
        calls.hold_bytes(call, len(piece))
        whole += piece
    return whole


async def encoded_reply(incoming: Incoming, reply: Reply) -> Reply:
    """``reply`` compressed as the client's ``Accept-Encoding`` asks (``encoded``)."""
    return await encoded(reply, incoming.headers.get("accept-encoding"))


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


@dataclass(frozen=True)
class CallHead:
    """What of a call's head its lifecycle reads: the target, the client's request id, when the
    head arrived, and the ``X-Request-Timeout`` and ``traceparent`` headers as sent (each its
    first value)."""

    target: str
    request_id: str | None
    started: float | None
    timeout: str | None
    trace_parent: str | None


async def run_call(
    incoming: Incoming,
    calls: Calls,
    protocol: str,
    work: Callable[[Call], Awaitable[Reply]],
    on_error: Callable[[int, Exception], Reply],
) -> Reply:
    """Run one inference call through the call lifecycle, answered over HTTP."""
    headers = incoming.headers
    head = CallHead(
        incoming.scope["path"],
        headers.get(REQUEST_ID_HEADER.lower()),
        incoming.scope.get("state", {}).get(STARTED_KEY),
        headers.get(TIMEOUT_HEADER.lower()),
        headers.get(TRACE_PARENT_HEADER),
    )

    async def read_then_work(call: Call) -> Reply:
        await incoming.body()
        return await until_disconnect(incoming.receive, lambda: work(call))

    return await run_head_call(calls, protocol, head, read_then_work, on_error)


async def run_head_call(
    calls: Calls,
    protocol: str,
    head: CallHead,
    work: Callable[[Call], Awaitable[Reply]],
    on_error: Callable[[int, Exception], Reply],
    left: Callable[[], bool] | None = None,
) -> Reply:
    """Run a call whose body is already read (or needs none) through the call lifecycle, on
    its ``head``. With ``left``, a cancellation while it runs is its client leaving when
    ``left()`` says so (whoever watches the client cancels this task), as ``until_disconnect``
    makes it for ``run_call``."""
    call = calls.open(protocol, head.target, safe_request_id(head.request_id), head.started)
    reply: Reply | None = None
    try:
        call.timeout_s = header_timeout_s(head.timeout)
        call.trace_parent = head.trace_parent
        reply = await work(call)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if left is None or not left() or current is None or current.uncancel() != 0:
            raise
        reply = Reply(CLIENT_GONE, content_type=None)
    except ClientGone:
        reply = Reply(CLIENT_GONE, content_type=None)
    except Exception as exc:
        calls.failed(call, exc)
        reply = on_error(status_of(exc), exc)
    finally:
        # A call cut by a shutdown is recorded as one its client never saw answered.
        calls.close(call, CLIENT_GONE if reply is None else reply.status)
    reply.headers.append((REQUEST_ID_HEADER, call.request_id))
    return reply
