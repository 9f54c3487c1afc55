"""The ASGI app of a front process: every HTTP call forwarded to the engine, as it arrives.

The engine serves the call with the app a single server runs, so the answer is the same
bytes; the front relays the request's body as the client sends it, the response's events as the
engine sends them, and a client that leaves (``http.disconnect``), so the engine's own checks
for a gone client still hold. When the engine cannot be reached the call gets 503 at once.

A small V2 inference request is decoded here instead (``nograd.front.decoding``): it reaches the
engine as tensors (``nograd.bridge.frames.DecodedCall``), and its answer comes back as tensors
(``nograd.bridge.frames.ANSWER``) that this front encodes, so the engine's one loop does neither
for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from nograd.bridge.frames import ABORT, ANSWER, DecodedCall
from nograd.bridge.link import DROPPED, EngineLink, LinkDown, Stream
from nograd.front.decoding import decodable, decoded_call, predecode
from nograd.http.connections import STARTED_KEY
from nograd.http.error_bodies import error_body, openai_error_body
from nograd.http.paths import OPENAI_PREFIX
from nograd.http.reply import answer_reply, encoded
from nograd.protocol.v2_handover import Answer
from nograd.serving.calls.access import Access
from nograd.serving.errors import RETRY_AFTER_S, Forbidden, Unauthenticated

Event = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]

SCOPE_KEYS: Final = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "headers",
    "client",
    "server",
)
"""What of a call's scope crosses to the engine (besides its arrival time)."""
ENGINE_AWAY: Final = "the engine process is not reachable (restarting); try again shortly"
LEAVING_GRACE_S: Final = 0.02
"""How long a call whose body is read runs before a task watches for its client leaving: most
are answered sooner, and a task per call is a noticeable share of a small model's call (the
engine's own watcher waits as long: ``nograd.http.exchange.DISCONNECT_GRACE_S``)."""


def wire_scope(scope: MutableMapping[str, Any]) -> dict[str, Any]:
    carried = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    started = scope.get("state", {}).get(STARTED_KEY)
    carried["state"] = {} if started is None else {STARTED_KEY: started}
    return carried


class ForwardingApp:
    def __init__(self, link: EngineLink, max_decoded_bytes: int, access: Access) -> None:
        """``access``: the server's keys; a call without a good one is never decoded here (the
        engine refuses it before reading its body, as a single server does)."""
        self._link = link
        self._max_decoded_bytes = max_decoded_bytes
        self._access = access

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # uvicorn runs no lifespan here, and a front speaks no WebSocket
        try:
            stream = self._link.open()
        except LinkDown:
            await refuse(scope["path"], send)
            return
        pump: asyncio.Task[None] | None = None
        timer: asyncio.TimerHandle | None = None

        def relay_request() -> None:
            nonlocal pump
            pump = asyncio.get_running_loop().create_task(_relay_request(receive, stream))

        try:
            first = await receive()
            whole = first["type"] == "http.request" and not first.get("more_body", False)
            decoded = self._decoded(scope, first) if whole else None
            try:
                if decoded is None:
                    stream.send(first, wire_scope(scope))
                else:
                    stream.open_decoded(decoded)
            except LinkDown:
                await refuse(scope["path"], send)
                return
            if first.get("more_body", False):
                relay_request()  # the rest of the body, as it comes
            elif first["type"] != "http.disconnect":
                timer = asyncio.get_running_loop().call_later(LEAVING_GRACE_S, relay_request)
            await _relay_response(scope, stream, send)
        finally:
            if timer is not None:
                timer.cancel()
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
            stream.close()

    def _decoded(self, scope: MutableMapping[str, Any], first: Event) -> DecodedCall | None:
        """The call as the engine serves it decoded, when this front could decode it."""
        target = decodable(scope)
        if target is None or not self._admits(scope):
            return None
        body = first.get("body", b"")
        predecoded = predecode(scope, body, self._max_decoded_bytes)
        if predecoded is None:
            return None
        return decoded_call(scope, target, len(body), predecoded)

    def _admits(self, scope: MutableMapping[str, Any]) -> bool:
        if not self._access.keys_required:
            return True
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        try:
            self._access.check(values, "http", None)
        except (Unauthenticated, Forbidden):
            return False
        return True


async def _relay_request(receive: Receive, stream: Stream) -> None:
    """The rest of the body, then the client's leaving, as they come."""
    while True:
        event = await receive()
        try:
            stream.send(event)
        except LinkDown:
            return
        if event["type"] == "http.disconnect":
            return


async def _relay_response(scope: MutableMapping[str, Any], stream: Stream, send: Send) -> None:
    path = scope["path"]
    started = False
    while True:
        event = await stream.receive()
        if event["type"] == ANSWER:
            await _encoded(scope, event, send)
            return
        if event is DROPPED or event["type"] == ABORT["type"]:
            if not started:
                if event is DROPPED:
                    await refuse(path, send)
                else:
                    await _internal_error(send)
            # Started and cut: returning unfinished makes the listener close the connection.
            return
        if event["type"] == "http.response.start":
            started = True
        await send(event)
        if event["type"] == "http.response.body" and not event.get("more_body", False):
            return


async def _encoded(scope: MutableMapping[str, Any], event: Event, send: Send) -> None:
    """An inference answer the engine left for this front to encode, encoded and sent as the
    engine would have sent it: its headers after the answer's own, compressed as asked."""
    reply = answer_reply(Answer.from_wire(event["answer"]))
    reply.headers.extend(event["headers"])
    accept = next((v for k, v in scope["headers"] if k == b"accept-encoding"), None)
    reply = await encoded(reply, None if accept is None else accept.decode("latin-1"))
    await reply.send(send)


async def refuse(path: str, send: Send) -> None:
    """503 with Retry-After: the engine is away, as a server that is not ready answers."""
    if path.startswith(OPENAI_PREFIX):
        body = openai_error_body(503, ENGINE_AWAY)
    else:
        body = error_body(ENGINE_AWAY)
    retry = (b"retry-after", str(RETRY_AFTER_S).encode())
    await _answer(send, 503, b"application/json", body, retry)


async def _internal_error(send: Send) -> None:
    """What an ASGI server answers when its app fails before answering."""
    await _answer(send, 500, b"text/plain; charset=utf-8", b"Internal Server Error")


async def _answer(
    send: Send, status: int, content_type: bytes, body: bytes, *headers: tuple[bytes, bytes]
) -> None:
    length = str(len(body)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", length), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
