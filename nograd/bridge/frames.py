"""Frames on a front's connection to the engine: ``stream id, length, payload``.

One connection carries every call of a front at once, each on its own stream: a request's
scope and its body events one way, its response events the other. A payload is a pickled ASGI
event, or, opening a stream, the pickled scope and the request's first event, or (``DECODED``)
a V2 inference call its front decoded (``DecodedCall``), served without ASGI. Both ends are
nograd processes started by one supervisor over a private socket, so pickle carries nothing a
client wrote without it being bytes inside an event.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any, Final, NamedTuple

HEADER: Final = struct.Struct("!II")
"""Stream id, then the payload's length."""
MAX_FRAME_BYTES: Final = 1 << 31
"""Largest payload a frame may declare; a longer one means the peer is broken."""
ABORT: Final = {"type": "nograd.abort"}
"""The engine's app failed on a stream without a complete answer: the front closes it as an
ASGI server closes a connection whose app raised."""


ANSWER: Final = "nograd.answer"
"""The event an engine sends for an inference answer its front encodes: ``answer`` (a
``nograd.protocol.v2_handover.Answer`` as plain values) and the answer's own ``headers``
(``nograd.http.reply.Reply``); it ends its stream."""
DECODED: Final = "nograd.decoded"
"""Opens a stream with a ``DecodedCall`` (as a plain tuple) instead of a scope."""


class DecodedCall(NamedTuple):
    """A V2 inference call its front decoded, as the engine serves it: what of its head the
    engine's checks and the call's lifecycle read (header values are each header's first, as
    sent), and the request (``nograd.protocol.v2_handover.Predecoded`` as plain values). It
    crosses as a plain tuple (``tuple(call)``): pickle then looks up no class."""

    path: str
    name: str
    version: str | None
    started: float | None
    request_id: str | None
    timeout: str | None
    trace_parent: str | None
    authorization: tuple[bytes, ...]
    length: int
    """The body's Content-Length."""
    request: tuple[Any, ...]


class FrameError(Exception):
    """The peer sent bytes that are no frame: the connection is dropped."""


def frame(stream: int, payload: Any) -> bytes:
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(stream, len(body)) + body


class FrameReader:
    """Splits the bytes of a connection into ``(stream, payload)``, whatever their chunks."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, Any]]:
        buffer = self._buffer
        buffer += data
        frames: list[tuple[int, Any]] = []
        offset = 0
        size = len(buffer)
        with memoryview(buffer) as view:
            while size - offset >= HEADER.size:
                stream, length = HEADER.unpack_from(view, offset)
                if length >= MAX_FRAME_BYTES:
                    raise FrameError(f"a frame of {length} bytes")
                end = offset + HEADER.size + length
                if end > size:
                    break
                frames.append((stream, pickle.loads(view[offset + HEADER.size : end])))
                offset = end
        del buffer[:offset]
        return frames


class Outbox:
    """Frames written together: every frame of one turn of the event loop leaves in one write,
    so many calls' small events cost one system call instead of one each."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def put(self, data: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not self._transport.is_closing():
            self._transport.write(b"".join(pending))
