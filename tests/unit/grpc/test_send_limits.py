"""Answers held for a client that takes none, over a real socket with a raw HTTP/2 client: a
stream that grants no window holds its high-water mark of unsent bytes and is handed no new
request meanwhile (all are answered once it grants a window); answers that stand still past
the timeout reset their stream, and other connections are served meanwhile; a client that reads
nothing from its socket makes the connection stop reading and is dropped. A large request
message is copied once, not twice, before it is parsed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

from nograd.grpc import frames as h2
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.h2 import Http2Connection, SendLimits, Stream
from nograd.grpc.rpc import CallContext, GrpcCalls, Method
from tests.unit.grpc.test_bidi import PATH, open_stream
from tests.unit.grpc.test_h2 import Peer, message

ANSWER_BYTES = 64 * 1024
LIMITS = SendLimits(stream_bytes=256 * 1024, connection_bytes=1024 * 1024, stuck_s=30.0)
REQUESTS = 200


class BigAnswers:
    """A stream servicer answering each request with ``ANSWER_BYTES`` of output, counting the
    requests it was handed."""

    def __init__(self) -> None:
        self.taken = 0

    async def __call__(
        self, requests: AsyncIterator[Any], context: CallContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        del context
        async for request in requests:
            self.taken += 1
            answer = pb.ModelInferResponse(id=request.id, raw_output_contents=[bytes(ANSWER_BYTES)])
            yield pb.ModelStreamInferResponse(infer_response=answer)


class Served:
    def __init__(self, servicer: BigAnswers, limits: SendLimits) -> None:
        self.servicer = servicer
        self.connections: list[Http2Connection] = []
        self.lost: list[asyncio.Event] = []
        """Set when each connection is gone."""
        self._calls = GrpcCalls(
            {PATH: Method(pb.ModelInferRequest, bidi_streaming=servicer)}, 1 << 20
        )
        self._limits = limits

    def protocol(self) -> Http2Connection:
        lost = asyncio.Event()
        connection = Http2Connection(self._calls, 8, lost.set, limits=self._limits)
        self.connections.append(connection)
        self.lost.append(lost)
        return connection


@contextlib.asynccontextmanager
async def serving(limits: SendLimits = LIMITS) -> AsyncIterator[tuple[Served, tuple[str, int]]]:
    served = Served(BigAnswers(), limits)
    server = await asyncio.get_running_loop().create_server(served.protocol, "127.0.0.1", 0)
    try:
        yield served, server.sockets[0].getsockname()[:2]
    finally:
        server.close()


async def client(address: tuple[str, int], window: int, receive_buffer: int | None = None) -> Peer:
    """A raw client whose streams start with ``window`` bytes of send window for the server."""
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(h2.PREFACE)
    peer = Peer(reader, writer)
    peer.send(h2.SETTINGS, 0, 0, struct.pack(">HL", h2.SETTINGS_INITIAL_WINDOW_SIZE, window))
    return peer


def requests(count: int) -> bytes:
    return b"".join(message(f"r{index}") for index in range(count))


async def settled(connection: Http2Connection) -> int:
    """The connection's unsent bytes once past the stream's mark and no longer changing (a
    loaded machine may take a while to get there), or as they are after 20 s."""
    last = -1
    for _ in range(100):
        held = connection.pending_bytes
        if held > LIMITS.stream_bytes and held == last:
            break
        last = held
        await asyncio.sleep(0.2)
    return last


async def answered(peer: Peer) -> tuple[list[str], str]:
    """The ids of the answers on stream 1 until its trailers, and its grpc-status."""
    body = bytearray()
    while True:
        kind, flags, stream, payload = await peer.frame()
        if kind == h2.DATA and stream == 1:
            body += payload
        elif kind == h2.HEADERS and flags & h2.END_STREAM:
            status = dict(peer.decoder.decode(payload, raw=False))["grpc-status"]
            break
    ids = []
    while body:
        size = int.from_bytes(body[1:5], "big")
        answer = pb.ModelStreamInferResponse.FromString(bytes(body[5 : 5 + size]))
        ids.append(answer.infer_response.id)
        del body[: 5 + size]
    return ids, status


async def test_a_stream_without_window_holds_its_mark_then_answers_all() -> None:
    async with serving() as (served, address):
        peer = await client(address, window=0)
        open_stream(peer)
        peer.send(h2.DATA, 0, 1, requests(REQUESTS))
        await asyncio.sleep(0.5)
        connection = served.connections[0]
        held = await settled(connection)
        await asyncio.sleep(0.5)  # nothing more is made meanwhile
        assert connection.pending_bytes == held
        # Before, every answer waited in the stream: 200 x 64 KiB.
        assert LIMITS.stream_bytes < held <= LIMITS.stream_bytes + ANSWER_BYTES + 1024
        assert served.servicer.taken <= LIMITS.stream_bytes // ANSWER_BYTES + 4
        peer.send(h2.WINDOW_UPDATE, 0, 1, struct.pack(">L", 2**30))
        peer.send(h2.WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**30))
        peer.send(h2.DATA, h2.END_STREAM, 1, b"")
        ids, status = await answered(peer)
        assert ids == [f"r{i}" for i in range(REQUESTS)] and status == "0"
        assert connection.pending_bytes == 0
        peer.writer.close()


async def test_answers_standing_still_reset_their_stream_and_others_are_served() -> None:
    limits = SendLimits(LIMITS.stream_bytes, LIMITS.connection_bytes, stuck_s=0.5)
    async with serving(limits) as (served, address):
        stuck = await client(address, window=0)
        open_stream(stuck)
        stuck.send(h2.DATA, 0, 1, requests(20))
        started = time.monotonic()
        _, _, stream, payload = await stuck.until(h2.RST_STREAM)
        assert stream == 1 and struct.unpack(">L", payload)[0] == h2.ENHANCE_YOUR_CALM
        assert time.monotonic() - started < 5
        assert served.connections[0].pending_bytes == 0
        # Another client on its own connection is answered as ever.
        other = await client(address, window=1 << 20)
        other.send(h2.WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 20))
        open_stream(other)
        other.send(h2.DATA, h2.END_STREAM, 1, message("other"))
        assert await answered(other) == (["other"], "0")
        stuck.writer.close()
        other.writer.close()


async def test_a_client_reading_nothing_is_bounded_then_dropped() -> None:
    limits = SendLimits(LIMITS.stream_bytes, LIMITS.connection_bytes, stuck_s=1.0)
    async with serving(limits) as (served, address):
        # Every window granted, but the socket never read past the kernel's buffers.
        peer = await client(address, window=2**31 - 1, receive_buffer=4096)
        peer.send(h2.WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1 - 65_535))
        peer.writer.transport.pause_reading()  # type: ignore[attr-defined]
        for stream in (1, 3, 5):
            open_stream_on(peer, stream)
            peer.send(h2.DATA, 0, stream, requests(REQUESTS))
        await asyncio.sleep(0.5)
        connection = served.connections[0]
        assert connection.pending_bytes <= LIMITS.connection_bytes + 3 * ANSWER_BYTES
        assert served.servicer.taken < 3 * REQUESTS // 2  # before, all 600 were answered
        await asyncio.wait_for(served.lost[0].wait(), 5)
        assert connection.pending_bytes == 0
        peer.writer.close()


def open_stream_on(peer: Peer, stream: int) -> None:
    peer.send(h2.HEADERS, h2.END_HEADERS, stream, peer.request_headers(PATH))


def test_a_large_unary_message_is_copied_once_before_it_is_parsed() -> None:
    """A large message refused by its shape made a worker's memory peak at several times its
    size: the body was copied whole, then sliced past its prefix (another copy), before protobuf
    copied it again. Now the one copy past the prefix is made as the body is freed."""
    size = 16 * 1024 * 1024
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=[bytes(size)])
    payload = request.SerializeToString()
    stream = Stream(1, [], 0)
    stream.body += b"\x00" + len(payload).to_bytes(4, "big") + payload
    del request, payload
    calls = GrpcCalls({}, 1 << 30)
    tracemalloc.start()
    try:
        parsed = calls._request(Method(pb.ModelInferRequest), "identity", stream)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed.model_name == "m" and not stream.body
    assert peak < size * 1.25, peak  # before: twice the message
