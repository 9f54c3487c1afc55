"""A front's end of the bridge: one connection to the engine, a stream per call, reconnected
when the engine comes back.

While the engine is away (restarting after a crash, or not started yet) the link is down: a call
opened then, or one under way when it drops, learns it at once (``LinkDown``), never waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Final, cast

from nograd.bridge.frames import DECODED, DecodedCall, FrameReader, Outbox, frame

logger = logging.getLogger(__name__)

RECONNECT_S: Final = 0.1
"""How often a link that is down tries the engine's socket again."""


class LinkDown(Exception):
    """The engine cannot be reached: it is restarting, or was never up."""


DROPPED: Final[MutableMapping[str, Any]] = {"type": "nograd.link_down"}
"""Put on every open stream when the connection drops."""


class Stream:
    """One call's way to the engine: events out with ``send``, the engine's with ``receive``."""

    def __init__(self, link: EngineLink, number: int) -> None:
        self._link = link
        self.number = number
        self.events: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        self._opened = False

    def send(self, event: MutableMapping[str, Any], scope: dict[str, Any] | None = None) -> None:
        """The call's first event goes with its ``scope``; raises ``LinkDown``."""
        payload: Any = (scope, event) if not self._opened else event
        self._opened = True
        self._link.write(frame(self.number, payload))

    def open_decoded(self, call: DecodedCall) -> None:
        """Open the stream with a call this front decoded; raises ``LinkDown``."""
        self._opened = True
        self._link.write(frame(self.number, (DECODED, tuple(call))))

    async def receive(self) -> MutableMapping[str, Any]:
        """The engine's next event, or ``DROPPED``."""
        return await self.events.get()

    def close(self) -> None:
        self._link.forget(self.number)


class EngineLink(asyncio.Protocol):
    """The connection to the engine's socket at ``path``, kept up by ``run``."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._transport: asyncio.Transport | None = None
        self._outbox: Outbox | None = None
        self._reader = FrameReader()
        self._streams: dict[int, Stream] = {}
        self._next = 1
        self._lost: asyncio.Event = asyncio.Event()
        self.connected = asyncio.Event()
        self._closing = False

    @property
    def up(self) -> bool:
        return self._transport is not None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def open(self) -> Stream:
        """A stream for a new call; raises ``LinkDown``."""
        if self._transport is None:
            raise LinkDown
        number = self._next
        self._next = number + 1 if number < 0xFFFFFFFF else 1
        stream = Stream(self, number)
        self._streams[number] = stream
        return stream

    def write(self, data: bytes) -> None:
        if self._outbox is None:
            raise LinkDown
        self._outbox.put(data)

    def forget(self, number: int) -> None:
        self._streams.pop(number, None)

    async def run(self) -> None:
        """Connect, and connect again whenever the connection drops, until ``close``."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                await loop.create_unix_connection(lambda: self, str(self._path))
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            await self._lost.wait()
            self._lost.clear()

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._outbox = Outbox(self._transport)
        self._reader = FrameReader()
        self.connected.set()
        logger.info("connected to the engine")

    def connection_lost(self, exc: Exception | None) -> None:
        del exc
        self._transport = self._outbox = None
        self.connected.clear()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.events.put_nowait(DROPPED)
        if not self._closing:
            logger.warning("the engine's connection dropped; calls get 503 until it is back")
        self._lost.set()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except Exception as exc:  # FrameError, or anything pickle raises on broken bytes
            logger.error("the engine sent a broken frame (%s); reconnecting", exc)
            if self._transport is not None:
                self._transport.close()
            return
        for number, event in frames:
            stream = self._streams.get(number)
            if stream is not None:
                stream.events.put_nowait(event)
