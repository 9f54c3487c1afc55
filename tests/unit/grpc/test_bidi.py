"""Bidirectional streams written frame by frame: messages split over DATA frames and several in
one, answers leaving before the client ends its side, a backlog past its bound, a stream that ends
inside a message."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from nograd.grpc import bidi
from nograd.grpc import frames as h2
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.h2 import Http2Connection
from nograd.grpc.rpc import CallContext, GrpcCalls, Method
from tests.unit.grpc.test_h2 import Peer, message

PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


async def echo(
    requests: AsyncIterator[Any], context: CallContext
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    del context
    async for request in requests:
        if request.id == "hold":
            await asyncio.sleep(30)
        yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id))


@contextlib.asynccontextmanager
async def streaming() -> AsyncIterator[Peer]:
    calls = GrpcCalls({PATH: Method(pb.ModelInferRequest, bidi_streaming=echo)}, 1 << 20)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Http2Connection(calls, 8, lambda: None), "127.0.0.1", 0
    )
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    writer.write(h2.PREFACE)
    peer = Peer(reader, writer)
    peer.send(h2.SETTINGS, 0, 0)
    try:
        yield peer
    finally:
        writer.close()
        server.close()


def open_stream(peer: Peer) -> None:
    peer.send(h2.HEADERS, h2.END_HEADERS, 1, peer.request_headers(PATH))


async def answer_id(peer: Peer) -> str:
    _, _, stream, payload = await peer.until(h2.DATA)
    assert stream == 1
    return str(pb.ModelStreamInferResponse.FromString(payload[5:]).infer_response.id)


async def status(peer: Peer) -> dict[str, str]:
    while True:
        _, flags, _, block = await peer.until(h2.HEADERS)
        decoded = dict(peer.decoder.decode(block, raw=False))
        if flags & h2.END_STREAM:
            return decoded


async def test_answers_leave_before_the_client_ends_its_side() -> None:
    async with streaming() as peer:
        open_stream(peer)
        first = message("a")
        peer.send(h2.DATA, 0, 1, first[:3])  # a message split over two frames
        peer.send(h2.DATA, 0, 1, first[3:])
        assert await answer_id(peer) == "a"
        peer.send(h2.DATA, 0, 1, message("b") + message("c"))  # two in one frame
        assert [await answer_id(peer), await answer_id(peer)] == ["b", "c"]
        peer.send(h2.DATA, h2.END_STREAM, 1, b"")
        assert (await status(peer))["grpc-status"] == "0"


async def test_a_stream_ending_inside_a_message_is_internal() -> None:
    async with streaming() as peer:
        open_stream(peer)
        peer.send(h2.DATA, h2.END_STREAM, 1, message("cut")[:-2])
        got = await status(peer)
        assert got["grpc-status"] == "13" and "inside a request message" in got["grpc-message"]


async def test_a_backlog_past_its_bound_ends_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bidi, "MAX_BACKLOG", 3)
    async with streaming() as peer:
        open_stream(peer)
        peer.send(h2.DATA, 0, 1, message("hold") + b"".join(message(f"m{i}") for i in range(5)))
        got = await status(peer)
        assert got["grpc-status"] == "8" and "wait to be served" in got["grpc-message"]
