"""The answers leaving an HTTP/2 connection (``nograd.grpc.h2``): DATA within the client's
windows, trailers once the data is out, and what waits for the client bounded.

Answers wait here for the client's window (and for the socket, while the kernel's buffer is
full): a sender awaits ``writable`` after each message, so what one stream and one connection
hold stays under their high-water marks (``SendLimits``); a client that grants no window keeps
its answers from leaving, never from being made. While the socket's buffer is full the
connection stops reading, so that client's next requests wait in TCP. A stream whose answers
have not moved for ``SendLimits.stuck_s`` is reset (RST_STREAM with ``ENHANCE_YOUR_CALM``), a
connection whose socket took nothing for that long ended (GOAWAY, then dropped), and what they
held is freed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nograd.grpc.frames import (
    CANCEL,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    frame,
)
from nograd.grpc.h2_stream import SendLimits, Stream

logger = logging.getLogger(__name__)


class AnswersOut:
    """The sending half of ``Http2Connection``: what it needs of the connection is declared
    here, the connection defines it."""

    limits: SendLimits
    pending_bytes: int
    """Answer bytes of every stream waiting to be written (DATA payloads and trailers)."""
    streams: dict[int, Stream]
    transport: asyncio.Transport | None
    closed: bool
    _send_window: int
    _max_send_frame: int
    _waiting: dict[int, Stream]
    """Streams a sender waits on, by id."""
    _write_paused: bool
    _paused_at: float
    _watch: asyncio.TimerHandle | None
    """Checks for answers that stand still, armed while any wait to be sent."""

    def _start_answers(self, limits: SendLimits | None) -> None:
        self.limits = limits or SendLimits()
        self.pending_bytes = 0
        self._waiting = {}
        self._write_paused = False
        self._paused_at = 0.0
        self._watch = None

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _finish(self, stream: Stream) -> None:
        raise NotImplementedError

    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        raise NotImplementedError

    def _fail(self, code: int, message: str) -> None:
        raise NotImplementedError

    def _abort(self) -> None:
        raise NotImplementedError

    def _drop_streams(self) -> None:
        raise NotImplementedError

    def pause_writing(self) -> None:
        """The socket's buffer is full (the client reads slowly or not at all): answers wait in
        their streams, where they are counted, and no request is read until it empties."""
        self._write_paused = True
        self._paused_at = time.monotonic()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._arm_watch()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        for stream in list(self.streams.values()):
            if stream.pending or stream.pending_end is not None:
                self._flush(stream)

    def send_headers(self, stream: Stream, block: bytes, *, end: bool = False) -> None:
        if stream.closed or self.closed:
            return
        flags = END_HEADERS | (END_STREAM if end else 0)
        stream.headers_sent = True
        self._write(frame(HEADERS, flags, stream.id, block))
        if end:
            self._finish(stream)

    def send_data(self, stream: Stream, data: bytes, trailers: bytes | None = None) -> None:
        """Queue ``data`` on ``stream`` and send what the windows allow; ``trailers`` (a header
        block) end the stream once all of it is sent."""
        if stream.closed or self.closed:
            return
        if not stream.pending and stream.pending_end is None:
            stream.moved_at = time.monotonic()
        stream.pending += data
        self.pending_bytes += len(data)
        if trailers is not None:
            stream.pending_end = frame(HEADERS, END_HEADERS | END_STREAM, stream.id, trailers)
            self.pending_bytes += len(stream.pending_end)
        self._flush(stream)
        if stream.pending or stream.pending_end is not None:
            self._arm_watch()

    def _flush(self, stream: Stream) -> None:
        if self._write_paused:
            return
        pending = stream.pending
        out = []
        sent = 0
        while pending:
            allowed = min(len(pending), stream.send_window, self._send_window, self._max_send_frame)
            if allowed <= 0:
                break
            out.append(frame(DATA, 0, stream.id, bytes(pending[:allowed])))
            del pending[:allowed]
            stream.send_window -= allowed
            self._send_window -= allowed
            sent += allowed
        if sent:
            self.pending_bytes -= sent
            stream.moved_at = time.monotonic()
        if not pending and stream.pending_end is not None:
            out.append(stream.pending_end)
            self.pending_bytes -= len(stream.pending_end)
            stream.pending_end = None
            self._write(b"".join(out))
            self._finish(stream)
            return
        if out:
            self._write(b"".join(out))
            if self._waiting:
                self._wake()

    def over_marks(self, stream: Stream) -> bool:
        """The stream, or its connection, holds more unsent answer bytes than its mark."""
        limits = self.limits
        return (
            len(stream.pending) > limits.stream_bytes
            or self.pending_bytes > limits.connection_bytes
        )

    async def writable(self, stream: Stream) -> None:
        """Return once the stream and its connection are back under their high-water marks (at
        once when they are), or the stream has ended: the caller checks ``stream.closed``. A
        wait is never endless: a stream whose answers stand still is reset (``_watch``)."""
        while not stream.closed and not self.closed and self.over_marks(stream):
            if stream.waiting is None or stream.waiting.done():
                stream.waiting = asyncio.get_running_loop().create_future()
            self._waiting[stream.id] = stream
            await stream.waiting

    def _arm_watch(self) -> None:
        if self._watch is None and not self.closed:
            loop = asyncio.get_running_loop()
            self._watch = loop.call_later(self.limits.stuck_s, self._check_stuck)

    def _check_stuck(self) -> None:
        """Reset each stream whose answers have not moved for ``stuck_s``, and end the
        connection when its socket took nothing for that long; check again while any wait."""
        self._watch = None
        if self.closed:
            return
        stuck_s = self.limits.stuck_s
        now = time.monotonic()
        if self._write_paused and now - self._paused_at >= stuck_s:
            message = f"answers not read for {stuck_s:g} s (NOGRAD_GRPC_UNSENT_TIMEOUT_S)"
            logger.info("gRPC connection ended: %s", message)
            self._fail(ENHANCE_YOUR_CALM, message)
            self._abort()
            self._drop_streams()
            return
        next_at = self._paused_at + stuck_s if self._write_paused else None
        for stream in list(self.streams.values()):
            if not stream.pending and stream.pending_end is None:
                continue
            if now - stream.moved_at >= stuck_s:
                logger.info(
                    "gRPC stream %d reset: its client took none of its answers for %g s",
                    stream.id,
                    stuck_s,
                )
                self.reset(stream, ENHANCE_YOUR_CALM)
                if stream.on_reset is not None:
                    stream.on_reset()
            elif next_at is None or stream.moved_at + stuck_s < next_at:
                next_at = stream.moved_at + stuck_s
        if next_at is not None and not self.closed:
            loop = asyncio.get_running_loop()
            self._watch = loop.call_later(max(next_at - now, 0.01), self._check_stuck)

    def _wake(self) -> None:
        """Let go on every waiting sender whose stream may now send (or has ended)."""
        for stream in list(self._waiting.values()):
            if stream.closed or self.closed or not self.over_marks(stream):
                del self._waiting[stream.id]
                if stream.waiting is not None and not stream.waiting.done():
                    stream.waiting.set_result(None)

    def _release(self, stream: Stream) -> None:
        """Forget what an ended stream still had to send, and wake whom that lets go on."""
        held = len(stream.pending) + (0 if stream.pending_end is None else len(stream.pending_end))
        if held:
            self.pending_bytes -= held
            stream.pending.clear()
            stream.pending_end = None
        if self._waiting:
            self._wake()
