"""HTTP/2 as gRPC uses it, served from the process's own event loop: frames, HPACK, flow control.

grpcio's asyncio server spends most of a small model's call in its own machinery (completion
queues, a poller thread handing events to the loop, a task and call object per RPC), and it hands
calls to the loop one at a time, so the batcher sees one or two requests where HTTP/1.1 hands it
a burst. This connection parses the frames of every stream that arrives in one read, in one loop
callback, as uvicorn does for HTTP/1.1 (BENCHMARKS.md has the measurements).

Only what gRPC needs of HTTP/2 is here, per RFC 9113: prior-knowledge cleartext connections (the
``h2c`` every gRPC client speaks on an insecure channel), streams that each carry one call, flow
control in both directions, SETTINGS, PING, GOAWAY, RST_STREAM and CONTINUATION. Header blocks are
decoded with ``hpack``; the server's own headers use literals without indexing, so it keeps no
encoder state. Answers leave through ``nograd.grpc.h2_send``, which bounds what waits for the
client.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Final

from nograd.grpc.frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_HEADER,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_HEADER_BLOCK,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECEIVE_FRAME_SIZE,
    RECEIVE_WINDOW,
    REFUSED_STREAM,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE,
    HeaderDecoder,
    ProtocolFailure,
    frame,
    unpad,
)
from nograd.grpc.h2_send import AnswersOut
from nograd.grpc.h2_stream import SendLimits, Stream, ended

__all__ = ["Handler", "Http2Connection", "SendLimits", "Stream"]

logger = logging.getLogger(__name__)
ABORT_AFTER_S: Final = 1.0
"""How long a connection ended by this side has to take its GOAWAY before it is dropped: one
whose client reads nothing would otherwise keep its unsent bytes until the peer goes away."""


class Handler:
    """What a connection calls for each new stream (implemented by the gRPC layer)."""

    def stream_opened(self, connection: Http2Connection, stream: Stream) -> None:
        raise NotImplementedError

    def stream_complete(self, connection: Http2Connection, stream: Stream) -> None:
        raise NotImplementedError


class Http2Connection(AnswersOut, asyncio.Protocol):
    """One client connection: frames in, streams to the handler, answers out."""

    def __init__(
        self,
        handler: Handler,
        max_streams: int,
        on_close: Callable[[], None],
        preface_timeout_s: float | None = None,
        refusal: str | None = None,
        limits: SendLimits | None = None,
    ) -> None:
        """``preface_timeout_s``: the time a new connection has to send the client preface (a
        silent one holds no slot); ``refusal``: turn it away at once (``ENHANCE_YOUR_CALM``);
        ``limits``: what its answers may hold."""
        self._refusal = refusal
        self._start_answers(limits)
        self._lost = False
        self._handler = handler
        self._max_streams = max_streams
        self._on_close = on_close
        self._preface_timeout_s = preface_timeout_s
        self._preface_timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface_seen = False
        self._decoder = HeaderDecoder()
        self.streams: dict[int, Stream] = {}
        self._last_stream = 0
        self._send_window = DEFAULT_WINDOW
        self._initial_send_window = DEFAULT_WINDOW
        self._max_send_frame = DEFAULT_FRAME_SIZE
        self._received = 0
        self._block: bytearray | None = None
        self._block_stream = 0
        self._block_flags = 0
        self.going_away = False
        self.closed = False

    # ------------------------------------------------------------------ connection events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        if self._refusal is not None:
            # No SETTINGS first: a client that saw the connection ready would send its calls
            # again on a new one at once, for as long as their deadline.
            self._fail(ENHANCE_YOUR_CALM, self._refusal)
            return
        settings = b"".join(
            SETTING.pack(key, value)
            for key, value in (
                (SETTINGS_MAX_CONCURRENT_STREAMS, self._max_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW),
                (SETTINGS_MAX_FRAME_SIZE, RECEIVE_FRAME_SIZE),
            )
        )
        raise_window = struct.pack(">L", RECEIVE_WINDOW - DEFAULT_WINDOW)
        self._write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, raise_window))
        if self._preface_timeout_s is not None:
            loop = asyncio.get_running_loop()
            self._preface_timer = loop.call_later(self._preface_timeout_s, self._preface_late)

    def _preface_late(self) -> None:
        if not self._preface_seen and not self.closed:
            self._fail(PROTOCOL_ERROR, "no HTTP/2 connection preface in time")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._preface_timer is not None:
            self._preface_timer.cancel()
        self.closed = True
        self._lost = True
        if self._watch is not None:
            self._watch.cancel()
        for stream in list(self.streams.values()):
            self._reset_locally(stream)
        self.streams.clear()
        self._wake()
        self._on_close()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        try:
            if not self._preface_seen:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buffer)):
                        raise ProtocolFailure(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if bytes(buffer[: len(PREFACE)]) != PREFACE:
                    raise ProtocolFailure(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buffer[: len(PREFACE)]
                self._preface_seen = True
                if self._preface_timer is not None:
                    self._preface_timer.cancel()
            offset = 0
            size = len(buffer)
            while size - offset >= 9:
                high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(buffer, offset)
                length = (high << 8) | low
                if length > RECEIVE_FRAME_SIZE:
                    raise ProtocolFailure(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = offset + 9 + length
                if end > size:
                    break
                payload = bytes(buffer[offset + 9 : end])
                offset = end
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            if offset:
                del buffer[:offset]
        except ProtocolFailure as exc:
            self._fail(exc.code, str(exc))

    # ------------------------------------------------------------------ frames in
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and kind != CONTINUATION:
            raise ProtocolFailure(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise ProtocolFailure(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                self._reset_locally(stream)
        elif kind == GOAWAY:
            self.going_away = True
            self._close_if_idle()
        elif kind == PUSH_PROMISE:
            raise ProtocolFailure(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 says.

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if flags & PADDED:
            payload = unpad(payload)
        self._received += len(payload) + (1 if flags & PADDED else 0)
        if self._received > RECEIVE_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", self._received)))
            self._received = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.received_all:
            if stream_id > self._last_stream or stream_id == 0:
                raise ProtocolFailure(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream this side closed or reset: its late data is dropped
        if not stream.body_refused:
            stream.body += payload
        stream.consumed += len(payload)
        if stream.consumed > RECEIVE_WINDOW // 2 and not flags & END_STREAM:
            self._write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">L", stream.consumed)))
            stream.consumed = 0
        if stream.on_data is not None:
            stream.on_data()
        if flags & END_STREAM:
            stream.received_all = True
            self._handler.stream_complete(self, stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolFailure(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & PADDED:
            payload = unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, payload)
        else:
            self._block, self._block_stream, self._block_flags = (
                bytearray(payload),
                stream_id,
                flags,
            )

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None or stream_id != self._block_stream:
            raise ProtocolFailure(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self._block += payload
        if len(self._block) > MAX_HEADER_BLOCK:
            raise ProtocolFailure(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            block, self._block = bytes(self._block), None
            self._header_block(stream_id, self._block_flags, block)

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client end its request
            if flags & END_STREAM and not stream.received_all:
                stream.received_all = True
                self._handler.stream_complete(self, stream)
            return
        if stream_id <= self._last_stream:
            return  # headers for a stream already closed: nothing to answer
        self._last_stream = stream_id
        if self.going_away:
            self._write(frame(RST_STREAM, 0, stream_id, struct.pack(">L", REFUSED_STREAM)))
            return
        if len(self.streams) >= self._max_streams:
            self._write(frame(RST_STREAM, 0, stream_id, struct.pack(">L", REFUSED_STREAM)))
            return
        stream = Stream(stream_id, headers, self._initial_send_window)
        self.streams[stream_id] = stream
        self._handler.stream_opened(self, stream)
        if flags & END_STREAM and stream_id in self.streams:
            stream.received_all = True
            self._handler.stream_complete(self, stream)

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolFailure(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = struct.unpack(">L", payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolFailure(FLOW_CONTROL_ERROR, "connection window overflow")
            for waiting in list(self.streams.values()):
                self._flush(waiting)
                if self._send_window <= 0:
                    break
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            self._flush(stream)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ProtocolFailure(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ProtocolFailure(FRAME_SIZE_ERROR, "bad SETTINGS")
        for offset in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolFailure(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._initial_send_window
                self._initial_send_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolFailure(PROTOCOL_ERROR, "bad max frame size")
                self._max_send_frame = value
            elif key == SETTINGS_HEADER_TABLE_SIZE:
                self._decoder.set_max_table_size(value)
        self._write(frame(SETTINGS, ACK, 0))
        for stream in list(self.streams.values()):
            self._flush(stream)

    # ------------------------------------------------------------------ answers out
    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        if stream.closed or self.closed:
            return
        stream.closed = True
        ended(stream)
        self.streams.pop(stream.id, None)
        self._release(stream)
        self._write(frame(RST_STREAM, 0, stream.id, struct.pack(">L", code)))
        self._close_if_idle()

    def _finish(self, stream: Stream) -> None:
        stream.closed = True
        ended(stream)
        self._release(stream)
        if self.streams.pop(stream.id, None) is not None and not stream.received_all:
            # Answered before the request ended (refused early): the peer may stop sending.
            self._write(frame(RST_STREAM, 0, stream.id, struct.pack(">L", NO_ERROR)))
        self._close_if_idle()

    def _reset_locally(self, stream: Stream) -> None:
        stream.closed = True
        ended(stream)
        self._release(stream)
        if stream.on_reset is not None:
            stream.on_reset()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    # ------------------------------------------------------------------ ending
    def go_away(self) -> None:
        """Take no new stream (the peer learns which was the last one served), and close once
        the streams under way are answered."""
        if self.going_away and self.closed:
            return
        self.going_away = True
        self._write(frame(GOAWAY, 0, 0, struct.pack(">LL", self._last_stream, NO_ERROR)))
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self.going_away and not self.streams and self.transport is not None:
            self.transport.close()

    def _fail(self, code: int, message: str) -> None:
        logger.debug("HTTP/2 connection error %d: %s", code, message)
        self._write(
            frame(GOAWAY, 0, 0, struct.pack(">LL", self._last_stream, code) + message.encode())
        )
        if self.transport is not None:
            self.transport.close()
            asyncio.get_running_loop().call_later(ABORT_AFTER_S, self._abort)
        self.closed = True

    def _abort(self) -> None:
        if not self._lost and self.transport is not None:
            self.transport.abort()

    def _drop_streams(self) -> None:
        """End every stream of a connection this side ended, at once: their calls stop and what
        they hold is freed without waiting for the socket to close."""
        for stream in list(self.streams.values()):
            self._reset_locally(stream)
        self.streams.clear()
