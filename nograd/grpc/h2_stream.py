"""One HTTP/2 stream as ``nograd.grpc.h2`` keeps it (the request arriving, the answer leaving),
and the limits on what the answers of a stream and of a connection may hold unsent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SendLimits:
    """High-water marks of answer bytes waiting to leave, and how long they may stand still."""

    stream_bytes: int = 4 * 1024 * 1024
    """A sender on a stream holding more waits (``writable``)."""
    connection_bytes: int = 64 * 1024 * 1024
    """A sender on a connection whose streams together hold more waits."""
    stuck_s: float = 30.0
    """A stream whose answers stood still this long is reset; a connection whose socket took
    nothing this long, ended."""


@dataclass
class Stream:
    """One stream of a connection: the request arriving, the answer leaving."""

    id: int
    headers: list[tuple[str, str]]
    send_window: int
    body: bytearray = field(default_factory=bytearray)
    received_all: bool = False
    body_refused: bool = False
    """The call stopped reading its requests (it failed): what more arrives is dropped."""
    pending: bytearray = field(default_factory=bytearray)
    """Answer bytes (DATA payload) waiting for window."""
    pending_end: bytes | None = None
    """The trailers' frame, sent once ``pending`` is."""
    closed: bool = False
    headers_sent: bool = False
    on_data: Callable[[], None] | None = None
    """Told when request bytes arrive (a stream that reads messages as they come)."""
    on_reset: Callable[[], None] | None = None
    """Told when the peer resets the stream or the connection ends."""
    on_closed: Callable[[], None] | None = None
    """Told once when the stream ends, whichever way (answered, reset by either side, the
    connection lost): what a stream holds is given back even when no call ever ran."""
    consumed: int = 0
    """Request bytes taken since the stream's last WINDOW_UPDATE."""
    moved_at: float = 0.0
    """When an answer byte last left (or, while none has since, when the first was queued)."""
    waiting: asyncio.Future[None] | None = None
    """Resolved when a sender waiting for the stream to be writable may go on."""


def ended(stream: Stream) -> None:
    """Tell the stream's ``on_closed`` once, however it ended."""
    closed, stream.on_closed = stream.on_closed, None
    if closed is not None:
        closed()
