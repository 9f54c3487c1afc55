"""HTTP/2 frames the grpcio client rarely sends, written by hand: PING, CONTINUATION, padding,
SETTINGS, a bad preface, a window pushed past its limit, a reset stream."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator

import hpack
import pytest

from nograd.grpc import frames as h2
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.h2 import Http2Connection
from nograd.grpc.rpc import CallContext, GrpcCalls, Method

PATH = "/inference.GRPCInferenceService/ModelInfer"


async def answer(request: pb.ModelInferRequest, context: CallContext) -> pb.ModelInferResponse:
    del context
    if request.id == "slow":
        await asyncio.sleep(30)
    return pb.ModelInferResponse(id=request.id)


class Peer:
    """A raw client connection: frames out, frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    def send(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> None:
        self.writer.write(h2.frame(kind, flags, stream, payload))

    async def frame(self) -> tuple[int, int, int, bytes]:
        head = await asyncio.wait_for(self.reader.readexactly(9), 5)
        length = int.from_bytes(head[:3], "big")
        payload = await asyncio.wait_for(self.reader.readexactly(length), 5)
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    async def until(self, kind: int) -> tuple[int, int, int, bytes]:
        while True:
            got = await self.frame()
            if got[0] == kind:
                return got

    def request_headers(self, path: str = PATH) -> bytes:
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "nograd"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )


def message(id: str) -> bytes:
    payload = pb.ModelInferRequest(id=id).SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


@contextlib.asynccontextmanager
async def connected(max_streams: int = 8, preface: bytes = h2.PREFACE) -> AsyncIterator[Peer]:
    """A raw connection to a server answering ModelInfer, having sent ``preface``."""
    calls = GrpcCalls({PATH: Method(pb.ModelInferRequest, unary=answer)}, 1 << 20)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Http2Connection(calls, max_streams, lambda: None), "127.0.0.1", 0
    )
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    writer.write(preface)
    try:
        yield Peer(reader, writer)
    finally:
        writer.close()
        server.close()


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    async with connected() as started:
        started.send(h2.SETTINGS, 0, 0)
        kind, flags, _, _ = await started.frame()
        assert kind == h2.SETTINGS and not flags & h2.ACK  # the server's own settings first
        yield started


async def test_ping_and_settings_are_acknowledged(peer: Peer) -> None:
    peer.send(h2.PING, 0, 0, b"12345678")
    _, flags, _, payload = await peer.until(h2.PING)
    assert flags & h2.ACK and payload == b"12345678"
    peer.send(h2.SETTINGS, 0, 0, struct.pack(">HL", h2.SETTINGS_MAX_FRAME_SIZE, 32768))
    _, flags, _, _ = await peer.until(h2.SETTINGS)
    while not flags & h2.ACK:
        _, flags, _, _ = await peer.until(h2.SETTINGS)


async def test_headers_split_over_continuation_with_padding(peer: Peer) -> None:
    block = peer.request_headers()
    padded = bytes([3]) + block[:10] + b"\x00\x00\x00"
    peer.send(h2.HEADERS, h2.PADDED, 1, padded)
    peer.send(h2.CONTINUATION, h2.END_HEADERS, 1, block[10:])
    data = message("split")
    peer.send(h2.DATA, h2.PADDED | h2.END_STREAM, 1, bytes([2]) + data + b"\x00\x00")
    _, _, stream, payload = await peer.until(h2.DATA)
    assert stream == 1
    assert pb.ModelInferResponse.FromString(payload[5:]).id == "split"
    _, flags, _, trailers = await peer.until(h2.HEADERS)
    assert flags & h2.END_STREAM
    assert ("grpc-status", "0") in peer.decoder.decode(trailers, raw=False)


async def test_a_reset_stream_cancels_its_call_and_others_go_on(peer: Peer) -> None:
    peer.send(h2.HEADERS, h2.END_HEADERS, 1, peer.request_headers())
    peer.send(h2.DATA, h2.END_STREAM, 1, message("slow"))
    peer.send(h2.RST_STREAM, 0, 1, struct.pack(">L", h2.CANCEL))
    peer.send(h2.HEADERS, h2.END_HEADERS, 3, peer.request_headers())
    peer.send(h2.DATA, h2.END_STREAM, 3, message("after"))
    _, _, stream, payload = await peer.until(h2.DATA)
    assert stream == 3 and pb.ModelInferResponse.FromString(payload[5:]).id == "after"


async def test_a_window_past_its_limit_ends_the_connection(peer: Peer) -> None:
    peer.send(h2.WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1))
    _, _, _, payload = await peer.until(h2.GOAWAY)
    assert struct.unpack(">L", payload[4:8])[0] == h2.FLOW_CONTROL_ERROR
    assert await asyncio.wait_for(peer.reader.read(), 5) == b""


async def test_streams_over_the_limit_are_refused() -> None:
    async with connected(max_streams=2) as peer:
        for stream in (1, 3, 5):
            peer.send(h2.HEADERS, h2.END_HEADERS, stream, peer.request_headers())
        _, _, stream, payload = await peer.until(h2.RST_STREAM)
        assert stream == 5 and struct.unpack(">L", payload)[0] == h2.REFUSED_STREAM


async def test_a_connection_that_is_not_http2_is_closed() -> None:
    async with connected(preface=b"GET / HTTP/1.1\r\nhost: x\r\n\r\n") as peer:
        received = await asyncio.wait_for(peer.reader.read(), 5)  # until the server closes it
    kinds, offset = [], 0
    while offset + 9 <= len(received):
        kinds.append((received[offset + 3], received[offset + 9 : offset + 17]))
        offset += 9 + int.from_bytes(received[offset : offset + 3], "big")
    goaway = [payload for kind, payload in kinds if kind == h2.GOAWAY]
    assert goaway and struct.unpack(">L", goaway[0][4:8])[0] == h2.PROTOCOL_ERROR
