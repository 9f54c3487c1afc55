"""The engine's end of the bridge: each front's connection, its streams run on the engine's app.

Every HTTP call a front accepted reaches the engine process as a stream on that front's
connection and is served by the same ASGI app a single server runs (the routes, middlewares and
serving core, unchanged), as if its own HTTP protocol had parsed it: the answers are the same
bytes. The front keeps the client's connection, its limits and its timeouts. A V2 inference call
its front decoded (``DECODED``) is served instead by ``decoded``, the same checks and lifecycle
without the ASGI layers, and cancelled when its client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, cast

from nograd.bridge.frames import ABORT, ANSWER, DECODED, FrameReader, Outbox, frame

logger = logging.getLogger(__name__)

App = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[MutableMapping[str, Any]]],
        Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]
"""An ASGI application (typed here without an HTTP framework)."""

Event = MutableMapping[str, Any]
Send = Callable[[Event], Awaitable[None]]
DecodedApp = Callable[[tuple[Any, ...], Send, Callable[[], bool]], Awaitable[None]]
"""Serves a decoded call (``nograd.bridge.frames.DecodedCall`` as a tuple) with ``send``;
cancelled when its client leaves, which the third argument then says."""

DISCONNECT = {"type": "http.disconnect"}


class DecodedStream:
    """A decoded call under way: the client's leaving (``http.disconnect``) cancels it."""

    __slots__ = ("left", "started", "task")

    def __init__(self) -> None:
        self.left = False
        self.started = False
        """Whether its task runs: one cancelled before its first step would skip its cleanup,
        so a client that leaves sooner only marks it ``left`` (its answer goes nowhere)."""
        self.task: asyncio.Task[None] | None = None

    def put_nowait(self, event: Event) -> None:
        if event["type"] == "http.disconnect" and not self.left:
            self.left = True
            if self.started and self.task is not None:
                self.task.cancel()


class BridgeHost:
    """Listens on a Unix socket for the fronts and serves their streams with ``app``."""

    def __init__(self, app: App, path: Path, decoded: DecodedApp | None = None) -> None:
        self._app = app
        self._decoded = decoded
        self._path = path
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[FrontConnection] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: FrontConnection(self._app, self._decoded, self.connections), str(self._path)
        )
        os.chmod(self._path, 0o600)

    @property
    def open_streams(self) -> int:
        """Calls under way from every front."""
        return sum(len(c.streams) for c in self.connections)

    async def stop(self) -> None:
        """Stop listening and cut what is left (the drain waited for the calls first)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()


class FrontConnection(asyncio.Protocol):
    """One front's connection: its streams, each a call running on the app."""

    def __init__(
        self, app: App, decoded: DecodedApp | None, registry: set[FrontConnection]
    ) -> None:
        self._app = app
        self._decoded = decoded
        self._registry = registry
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._outbox: Outbox | None = None
        self.streams: dict[int, asyncio.Queue[Event] | DecodedStream] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._outbox = Outbox(self._transport)
        self._registry.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        del exc
        self._registry.discard(self)
        self._transport = self._outbox = None
        # The front is gone, and with it every client of these calls: as a client that leaves.
        for queue in self.streams.values():
            queue.put_nowait(DISCONNECT)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except Exception as exc:  # FrameError, or anything pickle raises on broken bytes
            logger.error("a front sent a broken frame (%s); dropping its connection", exc)
            self.close()
            return
        for stream, payload in frames:
            queue = self.streams.get(stream)
            if queue is not None:
                queue.put_nowait(payload)
            elif isinstance(payload, tuple):
                if payload[0] == DECODED:
                    self._open_decoded(stream, payload[1])
                else:
                    scope, first = payload
                    self._open(stream, scope, first)
            # Else an event for a call that already ended (a client leaving as it was answered).

    def _open(self, stream: int, scope: dict[str, Any], first: Event) -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        queue.put_nowait(first)
        self.streams[stream] = queue
        self._start(stream, lambda send: self._app(scope, queue.get, send))

    def _open_decoded(self, stream: int, call: tuple[Any, ...]) -> None:
        decoded = self._decoded
        if decoded is None:  # a front newer than this engine: the call is cut, not guessed at
            logger.error("a front sent a decoded call this engine does not serve")
            if self._outbox is not None:
                self._outbox.put(frame(stream, ABORT))
            return
        state = DecodedStream()
        self.streams[stream] = state

        def serve(send: Send) -> Awaitable[None]:
            state.started = True
            return decoded(call, send, lambda: state.left)

        state.task = self._start(stream, serve)

    def _start(self, stream: int, serve: Callable[[Send], Awaitable[None]]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(
            self._serve(stream, serve), name=f"bridge-stream-{stream}"
        )
        self._tasks[stream] = task
        return task

    async def _serve(self, stream: int, serve: Callable[[Send], Awaitable[None]]) -> None:
        complete = False

        async def send(event: Event) -> None:
            nonlocal complete
            if (
                event["type"] == "http.response.body" and not event.get("more_body", False)
            ) or event["type"] == ANSWER:
                complete = True
            if self._outbox is not None:
                self._outbox.put(frame(stream, event))

        try:
            await serve(send)
        except Exception:
            logger.exception("the app failed on a call from a front")
        finally:
            if not complete and self._outbox is not None:
                self._outbox.put(frame(stream, ABORT))
            del self.streams[stream]
            del self._tasks[stream]
