"""Bidirectional streaming calls (Triton's ``ModelStreamInfer``): each request message decoded as
soon as it has arrived, the servicer's answers sent as they are ready, the call ended once the
client has closed its side and the servicer has answered everything.

Requests wait in a bounded backlog: a client that sends faster than the stream is answered is
ended with RESOURCE_EXHAUSTED rather than held in memory without end. Answers wait for the
client too: after each one the call waits while the stream (or its connection) holds more than
its high-water mark unsent, and no new request is handed to the servicer meanwhile, so a client
that takes no answers stops the work it asks for instead of piling up its answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from nograd.grpc.h2 import Http2Connection, Stream
from nograd.grpc.wire import (
    PREFIX_BYTES,
    RESPONSE_HEADERS,
    Abort,
    CallContext,
    Code,
    decompress,
    message_bytes,
    trailers,
)

logger = logging.getLogger(__name__)

BidiStreaming = Callable[[AsyncIterator[Any], CallContext], AsyncIterator[Message]]
MAX_BACKLOG: Final = 256
"""Request messages of one stream decoded and not yet taken by the servicer."""


class BidiCall:
    """One bidirectional call on its stream: request messages in as they arrive, answers out."""

    def __init__(
        self,
        connection: Http2Connection,
        stream: Stream,
        request_type: type[Message],
        servicer: BidiStreaming,
        context: CallContext,
        max_message_bytes: int,
        encoding: str,
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._request_type = request_type
        self._max = max_message_bytes
        self._encoding = encoding
        self._backlog: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = False
        stream.on_data = self._arrived
        self.task = asyncio.get_running_loop().create_task(self._run(servicer, context))
        stream.on_reset = self._reset

    def _reset(self) -> None:
        self.task.cancel()

    def _arrived(self) -> None:
        body = self._stream.body
        while len(body) >= PREFIX_BYTES and not self._ended:
            size = int.from_bytes(body[1:PREFIX_BYTES], "big")
            if size > self._max:
                message = f"received message larger than max ({size} vs. {self._max})"
                self._fail(Code.RESOURCE_EXHAUSTED, message)
                return
            if len(body) < PREFIX_BYTES + size:
                return
            compressed = body[0]
            payload = bytes(body[PREFIX_BYTES : PREFIX_BYTES + size])
            del body[: PREFIX_BYTES + size]
            try:
                if compressed:
                    payload = decompress(payload, self._encoding, self._max)
                message = self._request_type()
                message.ParseFromString(payload)
            except Abort as exc:
                self._fail(exc.code, exc.details)
                return
            except ProtobufDecodeError:
                name = self._request_type.DESCRIPTOR.full_name
                self._fail(Code.INTERNAL, f"a request is not a valid {name} message")
                return
            if self._backlog.qsize() >= MAX_BACKLOG:
                self._fail(
                    Code.RESOURCE_EXHAUSTED,
                    f"more than {MAX_BACKLOG} requests of one stream wait to be served: send "
                    "fewer at once, or on more streams",
                )
                return
            self._backlog.put_nowait(message)

    def requests_ended(self) -> None:
        """The client closed its side (END_STREAM): what is queued is served, then the call ends."""
        self._arrived()
        if self._ended:
            return
        if self._stream.body:
            self._fail(Code.INTERNAL, "the stream ended inside a request message")
            return
        self._backlog.put_nowait(None)

    async def _requests(self) -> AsyncIterator[Any]:
        connection, stream = self._connection, self._stream
        while True:
            await connection.writable(stream)  # no new work while the answers are stuck
            message = await self._backlog.get()
            if message is None or stream.closed:
                return
            yield message

    async def _run(self, servicer: BidiStreaming, context: CallContext) -> None:
        connection, stream = self._connection, self._stream
        connection.send_headers(stream, RESPONSE_HEADERS)
        try:
            async for response in servicer(self._requests(), context):
                if stream.closed:
                    return
                connection.send_data(stream, message_bytes(response))
                await connection.writable(stream)
            if not stream.closed:
                connection.send_data(stream, b"", trailers(Code.OK, "", context.trailing_metadata))
        except Abort as exc:
            self._end(exc.code, exc.details)
        except asyncio.CancelledError:
            if not stream.closed and not self._ended:
                connection.reset(stream)  # the client reset it, or the server stops
            raise
        except Exception:
            logger.exception("gRPC stream %s failed", self._request_type.DESCRIPTOR.name)
            self._end(Code.INTERNAL, "internal error")

    def _fail(self, code: Code, details: str) -> None:
        """Stop reading the stream and end the call with ``code``."""
        self._ended = True
        self._stream.on_data = None
        self._stream.body_refused = True  # its trailers may wait for the client a while
        self._stream.body.clear()
        self.task.cancel()
        self._end(code, details)

    def _end(self, code: Code, details: str) -> None:
        stream = self._stream
        if stream.closed:
            return
        if stream.headers_sent:
            self._connection.send_data(stream, b"", trailers(code, details))
        else:
            self._connection.send_headers(
                stream, RESPONSE_HEADERS + trailers(code, details), end=True
            )
