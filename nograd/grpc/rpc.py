"""gRPC calls over ``nograd.grpc.h2``: the request headers and message in, the servicer's answer
out as gRPC frames it (a 5-byte prefix per message, the status in trailers).

A servicer method is ``async (request, context) -> response`` for unary calls, or an async
iterator of responses for server-streaming ones. ``CallContext`` offers what servicers use of a
call (metadata, time remaining, trailing metadata, abort with a status). A method may draw on
``Limit``s of its own (health calls, watches), held from its headers to its stream's end, so
those calls never take the room inference calls need.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from nograd.grpc.bidi import BidiCall, BidiStreaming
from nograd.grpc.h2 import Handler, Http2Connection, Stream
from nograd.grpc.wire import (
    PREFIX_BYTES,
    RESPONSE_HEADERS,
    Abort,
    decompress,
    message_bytes,
    parse_timeout,
    trailers,
)
from nograd.grpc.wire import CallContext as CallContext
from nograd.grpc.wire import Code as Code
from nograd.serving.errors import QueueFull, retry_after_s

logger = logging.getLogger(__name__)


Unary = Callable[[Any, "CallContext"], Awaitable[Message]]
ServerStreaming = Callable[[Any, "CallContext"], AsyncIterator[Message]]


class Limit:
    """How many calls of one kind a process holds at once, apart from every other kind's: a
    flood of health watches fills its own limit and is refused there, never the streams and
    in-flight room inference calls need."""

    __slots__ = ("held", "maximum", "reason", "refusal")

    def __init__(self, maximum: int, refusal: str, reason: str) -> None:
        self.maximum = maximum
        self.refusal = refusal
        """The message a call past the limit is answered (RESOURCE_EXHAUSTED) with."""
        self.reason = reason
        """The refusal's ``reason`` in ``nograd_rejected_total``."""
        self.held = 0


@dataclass(frozen=True)
class Method:
    """One RPC: how its request is parsed, which servicer function answers it, and the limits
    each of its calls holds while its stream is open."""

    request_type: type[Message]
    unary: Unary | None = None
    server_streaming: ServerStreaming | None = None
    bidi_streaming: BidiStreaming | None = None
    limits: tuple[Limit, ...] = ()
    holds_body: bool = True
    """Its request messages draw on the process's byte budget as they arrive (health calls,
    bounded by their own limits, never do)."""


class ByteBudget(Protocol):
    """The process's budget of request bytes in flight
    (``nograd.serving.calls.lifecycle.Calls``)."""

    def take_bytes(self, size: int, name: str | None) -> None:
        """Draw ``size`` bytes, or raise ``QueueFull`` (counted) when they do not fit."""

    def give_bytes(self, size: int) -> None: ...


class GrpcCalls(Handler):
    """Answers each stream of a connection with the method its path names."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        max_message_bytes: int,
        on_refused: Callable[[str], None] | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        """``on_refused``: told the ``reason`` of each call refused for a ``Limit`` (metrics);
        ``budget``: what request messages draw on as they arrive (None: no budget)."""
        self._methods = methods
        self._max_message_bytes = max_message_bytes
        self._on_refused = on_refused
        self._budget = budget
        self.calls: set[asyncio.Task[None]] = set()
        """Unary calls under way, for the drain."""
        self._bidi: dict[int, BidiCall] = {}
        """Bidirectional calls by their stream (its ``id``), told when the client's side ends."""
        self.streams: set[asyncio.Task[None]] = set()
        """Server-streaming calls under way (health watches: they end with the connection)."""

    def stream_opened(self, connection: Http2Connection, stream: Stream) -> None:
        """Refuse at once what cannot be served, so a client that streams its request (or a
        huge one) is not read further."""
        headers = dict(stream.headers)
        method = self._methods.get(headers.get(":path", ""))
        refusal = _refusal(headers, method)
        if refusal is None and method is not None and method.limits:
            refusal = self._hold(stream, method.limits)
        if refusal is not None:
            connection.send_headers(stream, RESPONSE_HEADERS + trailers(*refusal), end=True)
            return
        assert method is not None
        if method.bidi_streaming is not None:
            self._open_bidi(connection, stream, method, method.bidi_streaming)
            return
        limit = self._max_message_bytes + PREFIX_BYTES
        budget = self._budget if method is not None and method.holds_body else None
        held = 0

        def refuse(block: bytes) -> None:
            stream.on_data = None
            stream.body.clear()
            connection.send_headers(stream, RESPONSE_HEADERS + block, end=True)

        def check_size() -> None:
            nonlocal held
            received = len(stream.body)
            if received > limit:
                size = int.from_bytes(stream.body[1:5], "big")
                message = f"received message larger than max ({size} vs. {limit - 5})"
                refuse(trailers(Code.RESOURCE_EXHAUSTED, message))
                return
            if budget is None or received <= held:
                return
            try:
                budget.take_bytes(received - held, None)
            except QueueFull as exc:
                extra = (("retry-after", str(retry_after_s(exc))),)
                refuse(trailers(Code.UNAVAILABLE, str(exc), extra))
                return
            held = received

        def give_back() -> None:
            if budget is not None and held:
                budget.give_bytes(held)

        stream.on_data = check_size
        if budget is not None:
            stream.on_closed = give_back

    def _hold(self, stream: Stream, limits: tuple[Limit, ...]) -> tuple[Code, str] | None:
        """Take one place in each of ``limits`` until the stream ends (however it ends), or
        none and the refusal when one is full."""
        for index, limit in enumerate(limits):
            if limit.held >= limit.maximum:
                for taken in limits[:index]:
                    taken.held -= 1
                if self._on_refused is not None:
                    self._on_refused(limit.reason)
                return Code.RESOURCE_EXHAUSTED, limit.refusal
            limit.held += 1

        def release() -> None:
            for limit in limits:
                limit.held -= 1

        stream.on_closed = release
        return None

    def _open_bidi(
        self, connection: Http2Connection, stream: Stream, method: Method, servicer: BidiStreaming
    ) -> None:
        headers = dict(stream.headers)
        timeout = headers.get("grpc-timeout")
        seconds = None if timeout is None else parse_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        metadata = [(k, v) for k, v in stream.headers if not k.startswith(":")]
        encoding = headers.get("grpc-encoding", "identity")
        call = BidiCall(
            connection,
            stream,
            method.request_type,
            servicer,
            CallContext(metadata, deadline),
            self._max_message_bytes,
            encoding,
        )
        self.streams.add(call.task)
        call.task.add_done_callback(self.streams.discard)
        self._bidi[id(stream)] = call

        def forget() -> None:
            self._bidi.pop(id(stream), None)

        stream.on_closed = forget

    def stream_complete(self, connection: Http2Connection, stream: Stream) -> None:
        bidi = self._bidi.get(id(stream))
        if bidi is not None:
            bidi.requests_ended()
            return
        if stream.closed:
            return
        headers = dict(stream.headers)
        method = self._methods[headers[":path"]]
        try:
            request = self._request(method, headers.get("grpc-encoding", "identity"), stream)
        except Abort as exc:
            connection.send_headers(
                stream, RESPONSE_HEADERS + trailers(exc.code, exc.details), end=True
            )
            return
        timeout = headers.get("grpc-timeout")
        seconds = None if timeout is None else parse_timeout(timeout)  # checked when it opened
        deadline = None if seconds is None else time.monotonic() + seconds
        metadata = [(k, v) for k, v in stream.headers if not k.startswith(":")]
        context = CallContext(metadata, deadline)
        task = asyncio.get_running_loop().create_task(
            self._run(connection, stream, method, request, context)
        )
        under_way = self.calls if method.unary is not None else self.streams
        under_way.add(task)
        task.add_done_callback(under_way.discard)

        def cancel() -> None:
            task.cancel()

        stream.on_reset = cancel

    def _request(self, method: Method, encoding: str, stream: Stream) -> Message:
        """The call's one message. Its bytes are copied once, past the prefix, and the stream's
        body freed before parsing (which copies them again): a large message is held twice at
        most while it is read, not three times."""
        body = stream.body
        try:
            if len(body) < PREFIX_BYTES:
                raise Abort(Code.INTERNAL, "the call carries no request message")
            size = int.from_bytes(body[1:5], "big")
            if len(body) != PREFIX_BYTES + size:
                raise Abort(Code.INTERNAL, "a unary call carries exactly one request message")
            compressed = body[0]
            with memoryview(body) as whole, whole[PREFIX_BYTES:] as after_prefix:
                payload = bytes(after_prefix)
        finally:
            body.clear()
        if compressed:
            payload = decompress(payload, encoding, self._max_message_bytes)
        request = method.request_type()
        try:
            request.ParseFromString(payload)
        except ProtobufDecodeError as exc:
            logger.debug("unparsable %s: %s", request.DESCRIPTOR.full_name, exc)
            refusal = f"the request is not a valid {request.DESCRIPTOR.full_name} message"
            raise Abort(Code.INTERNAL, refusal) from exc
        return request

    async def _run(
        self,
        connection: Http2Connection,
        stream: Stream,
        method: Method,
        request: Message,
        context: CallContext,
    ) -> None:
        try:
            # A connection whose answers wait for its client over their mark takes on no new
            # work until they leave (or stand still long enough to be reset).
            await connection.writable(stream)
            if stream.closed:
                return
            if method.server_streaming is not None:
                await _stream_responses(
                    connection, stream, method.server_streaming(request, context)
                )
                return
            assert method.unary is not None
            response = await method.unary(request, context)
            end = trailers(Code.OK, "", context.trailing_metadata)
            connection.send_headers(stream, RESPONSE_HEADERS)
            connection.send_data(stream, message_bytes(response), end)
        except Abort as exc:
            block = trailers(exc.code, exc.details, context.trailing_metadata)
            if stream.headers_sent:
                connection.send_data(stream, b"", block)
            else:
                connection.send_headers(stream, RESPONSE_HEADERS + block, end=True)
        except asyncio.CancelledError:
            connection.reset(stream)
            raise
        except Exception:
            logger.exception("gRPC call %s failed", type(request).__name__)
            block = trailers(Code.INTERNAL, "internal error")
            if stream.headers_sent:
                connection.send_data(stream, b"", block)
            else:
                connection.send_headers(stream, RESPONSE_HEADERS + block, end=True)


async def _stream_responses(
    connection: Http2Connection, stream: Stream, responses: AsyncIterator[Message]
) -> None:
    connection.send_headers(stream, RESPONSE_HEADERS)
    async for response in responses:
        if stream.closed:
            return
        connection.send_data(stream, message_bytes(response))
        await connection.writable(stream)
    connection.send_data(stream, b"", trailers(Code.OK))


def _refusal(headers: Mapping[str, str], method: Method | None) -> tuple[Code, str] | None:
    if headers.get(":method") != "POST":
        return Code.UNIMPLEMENTED, "gRPC calls are POST requests"
    if not headers.get("content-type", "").startswith("application/grpc"):
        return Code.UNKNOWN, "content-type must be application/grpc"
    if method is None:
        return Code.UNIMPLEMENTED, f"method {headers.get(':path', '')!r} is not served here"
    encoding = headers.get("grpc-encoding", "identity")
    if encoding not in ("identity", "gzip", "deflate"):
        return Code.UNIMPLEMENTED, f"messages compressed with {encoding[:32]!r} are not accepted"
    timeout = headers.get("grpc-timeout")
    if timeout is not None and parse_timeout(timeout) is None:
        # As HTTP answers a negative or malformed deadline header: 400, before the body is read.
        return Code.INVALID_ARGUMENT, (
            f"grpc-timeout must be 1 to 8 digits and a unit (H, M, S, m, u or n), "
            f"got {timeout[:32]!r}"
        )
    return None
