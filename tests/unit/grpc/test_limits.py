"""Health calls and watches hold limits of their own (``nograd.grpc.rpc.Limit``), from their
headers to their stream's end however it ends, so a flood of them is refused there and inference
calls on the same connection are still answered; and the settings keep those limits below a
connection's streams."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import hpack
import pydantic
import pytest

from nograd.grpc import frames as h2
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.h2 import Http2Connection
from nograd.grpc.rpc import CallContext, GrpcCalls, Limit, Method
from nograd.settings import Settings

INFER = "/inference.GRPCInferenceService/ModelInfer"
CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
STREAMS = 16
"""Each test connection's SETTINGS_MAX_CONCURRENT_STREAMS."""


async def echo(request: pb.ModelInferRequest, context: CallContext) -> pb.ModelInferResponse:
    del context
    return pb.ModelInferResponse(id=request.id)


async def forever(
    request: pb.ModelInferRequest, context: CallContext
) -> AsyncIterator[pb.ModelInferResponse]:
    """A watch: one answer, then open until the client leaves."""
    del context
    yield pb.ModelInferResponse(id=request.id)
    await asyncio.Event().wait()


class Served:
    def __init__(self, address: str, health: Limit, watches: Limit, refusals: list[str]) -> None:
        self.address = address
        self.health = health
        self.watches = watches
        self.refusals = refusals


@contextlib.asynccontextmanager
async def served(health_calls: int = 6, watches: int = 4) -> AsyncIterator[Served]:
    health = Limit(health_calls, "too many health calls", "health_calls")
    watching = Limit(watches, "too many health watches", "health_watches")
    methods = {
        INFER: Method(pb.ModelInferRequest, unary=echo),
        CHECK: Method(pb.ModelInferRequest, unary=echo, limits=(health,)),
        WATCH: Method(pb.ModelInferRequest, server_streaming=forever, limits=(health, watching)),
    }
    refusals: list[str] = []
    calls = GrpcCalls(methods, 1 << 20, refusals.append)
    connections: list[Http2Connection] = []

    def connection() -> Http2Connection:
        connections.append(Http2Connection(calls, STREAMS, lambda: None))
        return connections[-1]

    server = await asyncio.get_running_loop().create_server(connection, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        yield Served(f"127.0.0.1:{port}", health, watching, refusals)
    finally:
        server.close()
        for made in connections:
            if made.transport is not None:
                made.transport.close()


def method(channel: grpc.aio.Channel, path: str, streaming: bool = False) -> Callable[..., Any]:
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(
        path,
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


async def until(condition: Callable[[], bool]) -> None:
    """Within 5 s: a limit is given back by the server's own callbacks, with nothing to await."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 5 s")


async def test_watches_past_their_limit_are_refused_and_inference_goes_on() -> None:
    """Four times the connection's streams in watches, on the connection inference uses: the
    limit's watches stay open, the rest are RESOURCE_EXHAUSTED at once, and every inference
    call and health check on that connection is answered."""
    async with served() as server, grpc.aio.insecure_channel(server.address) as channel:
        watch = method(channel, WATCH, streaming=True)
        calls = [watch(pb.ModelInferRequest(id="w"), timeout=10) for _ in range(4 * STREAMS)]

        async def first(call: Any) -> str:
            try:
                return str((await call.read()).id)
            except grpc.aio.AioRpcError as exc:
                assert "too many health" in (exc.details() or "")
                return str(exc.code())

        answers = await asyncio.wait_for(asyncio.gather(*(first(c) for c in calls)), 10)
        assert answers.count("w") == 4
        assert answers.count(str(grpc.StatusCode.RESOURCE_EXHAUSTED)) == 4 * STREAMS - 4
        assert server.watches.held == 4 and server.health.held == 4
        assert set(server.refusals) == {"health_watches"}
        infer = method(channel, INFER)
        ids = [str(i) for i in range(3 * STREAMS)]
        done = await asyncio.gather(*(infer(pb.ModelInferRequest(id=i), timeout=10) for i in ids))
        assert [d.id for d in done] == ids
        assert (await method(channel, CHECK)(pb.ModelInferRequest(id="c"), timeout=10)).id == "c"
        for call in calls:
            call.cancel()
        await until(lambda: server.watches.held == 0 and server.health.held == 0)
        again = watch(pb.ModelInferRequest(id="again"), timeout=10)
        assert (await again.read()).id == "again"
        again.cancel()


async def test_health_calls_past_their_limit_are_refused() -> None:
    """Watches fill the health calls' limit too; a check past it is refused, and answered once
    a watch ends."""
    async with served(health_calls=2, watches=2) as server:
        async with grpc.aio.insecure_channel(server.address) as channel:
            watches = [
                method(channel, WATCH, streaming=True)(pb.ModelInferRequest(), timeout=10)
                for _ in range(2)
            ]
            for call in watches:
                await call.read()
            check = method(channel, CHECK)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await check(pb.ModelInferRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.details() == "too many health calls"
            assert server.refusals == ["health_calls"]
            watches[0].cancel()
            await until(lambda: server.health.held == 1)
            assert (await check(pb.ModelInferRequest(id="2"), timeout=10)).id == "2"
            watches[1].cancel()
        await until(lambda: server.health.held == 0 and server.watches.held == 0)


async def test_a_stream_that_never_sends_its_request_is_held_and_given_back() -> None:
    """Headers without a message still hold their place (the limit counts from the headers), and
    it comes back when the peer resets the stream or the connection is lost."""
    async with served(health_calls=3, watches=2) as server:
        host, port = server.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        encoder = hpack.Encoder()
        block = encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", WATCH),
                (":authority", "nograd"),
                ("content-type", "application/grpc"),
            ]
        )
        writer.write(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0))
        for stream in (1, 3, 5):
            writer.write(h2.frame(h2.HEADERS, h2.END_HEADERS, stream, block))
        await until(lambda: server.watches.held == 2 and server.refusals == ["health_watches"])
        writer.write(h2.frame(h2.RST_STREAM, 0, 1, struct.pack(">L", h2.CANCEL)))
        await until(lambda: server.watches.held == 1 and server.health.held == 1)
        writer.close()
        await until(lambda: server.watches.held == 0 and server.health.held == 0)
        del reader


def test_settings_keep_health_below_a_connection_s_streams() -> None:
    defaults = Settings()
    assert (
        defaults.grpc_max_health_watches
        < defaults.grpc_max_health_calls
        < defaults.grpc_max_concurrent_streams
    )
    for wrong in (
        {"grpc_max_concurrent_streams": 64},  # not above the health calls' 64
        {"grpc_max_health_watches": 64},  # watches would leave checks no room
        {"grpc_max_health_calls": 300},
    ):
        with pytest.raises(pydantic.ValidationError, match="grpc_max_health_watches"):
            Settings(**wrong)  # type: ignore[arg-type]
    fits = Settings(
        grpc_max_concurrent_streams=100, grpc_max_health_calls=16, grpc_max_health_watches=8
    )
    assert fits.grpc_max_concurrent_streams == 100
