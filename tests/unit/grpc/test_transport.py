"""nograd's HTTP/2 gRPC transport against grpcio's own client (the C core every gRPC client
library here is built on): unary and streaming calls, flow control with messages larger than
every window, multiplexing, statuses, deadlines, cancellation, compression and GOAWAY."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.h2 import Http2Connection
from nograd.grpc.rpc import CallContext, Code, GrpcCalls, Method

PATH = "/inference.GRPCInferenceService/"
LIMIT = 8 * 1024 * 1024


class Served:
    def __init__(self, calls: GrpcCalls, server: asyncio.AbstractServer) -> None:
        self.calls = calls
        self.server = server
        self.connections: list[Http2Connection] = []
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.seen: list[CallContext] = []
        self.cancelled = asyncio.Event()


async def echo(request: pb.ModelInferRequest, context: CallContext) -> pb.ModelInferResponse:
    """Answers ``parameters['size']`` bytes (default: the request's own raw bytes)."""
    size = request.parameters["size"].int64_param if "size" in request.parameters else None
    payload = b"r" * size if size is not None else b"".join(request.raw_input_contents)
    return pb.ModelInferResponse(id=request.id, raw_output_contents=[payload])


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    holder: list[Served] = []

    async def remember(request: pb.ModelInferRequest, context: CallContext) -> Any:
        holder[0].seen.append(context)
        if request.id == "abort":
            context.set_trailing_metadata((("retry-after", "3"),))
            await context.abort(Code.UNAVAILABLE, "busy: ünïcode % and\nnewline")
        if request.id == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                holder[0].cancelled.set()
                raise
        if request.id == "crash":
            raise RuntimeError("the servicer broke")
        return await echo(request, context)

    async def count(request: pb.ModelInferRequest, context: CallContext) -> Any:
        for index in range(int(request.id)):
            yield pb.ModelInferResponse(id=str(index))

    methods = {
        PATH + "ModelInfer": Method(pb.ModelInferRequest, unary=remember),
        PATH + "ModelStreamInfer": Method(pb.ModelInferRequest, server_streaming=count),
    }
    calls = GrpcCalls(methods, LIMIT)
    loop = asyncio.get_running_loop()
    connections: list[Http2Connection] = []

    def connection() -> Http2Connection:
        made = Http2Connection(calls, 100, lambda: None)
        connections.append(made)
        return made

    server = await loop.create_server(connection, "127.0.0.1", 0)
    holder.append(Served(calls, server))
    holder[0].connections = connections
    try:
        yield holder[0]
    finally:
        server.close()
        for made in connections:
            if made.transport is not None:
                made.transport.close()


def unary(channel: grpc.aio.Channel, name: str = "ModelInfer") -> Callable[..., Any]:
    return channel.unary_unary(
        PATH + name,
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def request(id: str = "", raw: bytes = b"", size: int | None = None) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(id=id, raw_input_contents=[raw] if raw else [])
    if size is not None:
        message.parameters["size"].int64_param = size
    return message


async def test_a_unary_call_and_messages_larger_than_every_window(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        call = unary(channel)
        small = await call(request("a", b"xyz"))
        assert small.id == "a" and small.raw_output_contents == [b"xyz"]
        # 3 MiB each way: past the 64 KiB windows a client starts with, and its frame size.
        big = await call(request("b", b"q" * (3 << 20)), timeout=20)
        assert big.raw_output_contents == [b"q" * (3 << 20)]
        answer = await call(request("c", size=(4 << 20) - 100), timeout=20)
        assert len(answer.raw_output_contents[0]) == (4 << 20) - 100


async def test_many_calls_share_one_connection(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        call = unary(channel)
        answers = await asyncio.gather(
            *(
                call(request(str(i), b"%d" % i, size=70_000 if i % 7 == 0 else None))
                for i in range(300)
            )
        )
    assert [a.id for a in answers] == [str(i) for i in range(300)]
    assert len(served.connections) == 1


async def test_statuses_carry_their_message_and_trailing_metadata(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await unary(channel)(request("abort"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "busy: ünïcode % and\nnewline"
        assert ("retry-after", "3") in tuple(refused.value.trailing_metadata() or ())
        with pytest.raises(grpc.aio.AioRpcError) as crashed:
            await unary(channel)(request("crash"))
        assert crashed.value.code() == grpc.StatusCode.INTERNAL
        assert "broke" not in (crashed.value.details() or "")  # no internals leak
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await unary(channel, "NoSuchMethod")(request())
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_an_oversized_message_is_refused_before_it_is_read_whole(served: Served) -> None:
    async with grpc.aio.insecure_channel(
        served.address, options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await unary(channel)(request("x", b"z" * (LIMIT + 1)), timeout=20)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (refused.value.details() or "")
        # The connection still serves.
        assert (await unary(channel)(request("ok", b"1"))).id == "ok"


async def test_deadlines_reach_the_servicer_and_cancels_cancel_it(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        await unary(channel)(request("d"), timeout=7.5)
        remaining = served.seen[-1].time_remaining()
        assert remaining is not None and 5.0 < remaining < 7.6  # the client rounds it up
        await unary(channel)(request("e"))
        assert served.seen[-1].time_remaining() is None
        call = unary(channel)(request("slow"))
        await asyncio.sleep(0.3)
        call.cancel()
        await asyncio.wait_for(served.cancelled.wait(), 5)
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await unary(channel)(request("slow"), timeout=0.3)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_compressed_requests_are_read(served: Served) -> None:
    async with grpc.aio.insecure_channel(
        served.address, compression=grpc.Compression.Gzip
    ) as channel:
        answer = await unary(channel)(request("g", b"compress me " * 1000))
    assert answer.raw_output_contents == [b"compress me " * 1000]


async def test_server_streaming_sends_each_message(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        stream = channel.unary_stream(
            PATH + "ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        ids = [message.id async for message in stream(request("5"))]
    assert ids == ["0", "1", "2", "3", "4"]


async def test_go_away_finishes_the_calls_under_way_and_takes_no_new_one(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        call = unary(channel)
        assert (await call(request("warm"))).id == "warm"
        under_way = asyncio.ensure_future(call(request("c", size=1000), timeout=10))
        await asyncio.sleep(0)
        for connection in served.connections:
            connection.go_away()
        answer = await under_way
        assert answer.id == "c"
    await asyncio.sleep(0.2)
    assert all(c.transport is None or c.transport.is_closing() for c in served.connections)
