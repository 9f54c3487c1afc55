"""A flood of ``grpc.health.v1.Health/Watch`` streams, sent without a key to a real server with
two workers and API keys, does not stop authenticated inference: watches hold limits of their
own (``NOGRAD_GRPC_MAX_HEALTH_WATCHES``, ``NOGRAD_GRPC_MAX_HEALTH_CALLS``), apart from the
streams a connection may hold (``NOGRAD_GRPC_MAX_CONCURRENT_STREAMS``) and from inference's
requests in flight. Before, a connection's streams were ``NOGRAD_MAX_REQUESTS_IN_FLIGHT`` and
watches never ended: on a connection shared with inference (a proxy's, or a client's channel)
the watches took every stream and every inference call waited until its deadline."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.e2e.serving import digits_repository, free_port, metric_value, run_server

pytestmark = pytest.mark.e2e

KEY = "grpc-flood-key-0123456789"
IN_FLIGHT = 32
"""The old shared limit, set low so the flood passes it: each connection's streams were this."""
WATCHES_PER_WORKER = 8
CHANNELS = 3
WATCHES_PER_CHANNEL = 100
"""300 watches in all, each channel's three times the old limit of its connection."""
INFERENCE_CALLS = 40


def _request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
    request.raw_input_contents.append(np.zeros(64, np.float32).tobytes())
    return request


async def _flood_then_infer(address: str) -> tuple[Counter[str], Counter[str], str]:
    """Watches without a key on every channel, then inference with the key on those same
    channels (same connections) while the watches stay open; the watches' first answers, the
    inference answers, and the health check's status."""
    own = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
    channels = [grpc.aio.insecure_channel(address, options=own) for _ in range(CHANNELS)]
    watches = []
    try:
        for channel in channels:
            health = health_pb2_grpc.HealthStub(channel)
            watches += [
                health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
                for _ in range(WATCHES_PER_CHANNEL)
            ]

        async def first(call: grpc.aio.UnaryStreamCall) -> str:
            try:
                answer = await asyncio.wait_for(call.read(), 20)
            except TimeoutError:
                return "no answer"  # a stream the connection had no room for
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))

        firsts = Counter(await asyncio.gather(*map(first, watches)))

        async def infer(index: int) -> str:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channels[index % CHANNELS])
            try:
                answer = await stub.ModelInfer(
                    _request(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK" if answer.raw_output_contents else "empty"

        answers = Counter(
            await asyncio.wait_for(asyncio.gather(*map(infer, range(INFERENCE_CALLS))), 30)
        )
        try:
            checked = await health_pb2_grpc.HealthStub(channels[0]).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return firsts, answers, exc.code().name
        return firsts, answers, health_pb2.HealthCheckResponse.ServingStatus.Name(checked.status)
    finally:
        for call in watches:
            call.cancel()
        for channel in channels:
            await channel.close()


def test_a_watch_flood_without_a_key_leaves_inference_answering(tmp_path: Path) -> None:
    repo = digits_repository(tmp_path)
    port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(port),
        "NOGRAD_WORKERS": "2",
        "NOGRAD_API_KEYS": KEY,
        "NOGRAD_ENGINE": "eager",
        "NOGRAD_MAX_REQUESTS_IN_FLIGHT": str(IN_FLIGHT),
        "NOGRAD_GRPC_MAX_CONCURRENT_STREAMS": "64",
        "NOGRAD_GRPC_MAX_HEALTH_CALLS": "16",
        "NOGRAD_GRPC_MAX_HEALTH_WATCHES": str(WATCHES_PER_WORKER),
    }
    with run_server(tmp_path, env) as server:
        firsts, answers, status = asyncio.run(
            asyncio.wait_for(_flood_then_infer(f"127.0.0.1:{port}"), 120)
        )
        refused = metric_value(server.url, "nograd_rejected_total", reason="health_watches")
        log = server.log()
    assert answers == {"OK": INFERENCE_CALLS}, (answers, firsts)
    assert status == "SERVING"
    # Two workers, each holding its limit's watches open and refusing the rest at once.
    assert 1 <= firsts["SERVING"] <= 2 * WATCHES_PER_WORKER, firsts
    assert firsts["RESOURCE_EXHAUSTED"] == CHANNELS * WATCHES_PER_CHANNEL - firsts["SERVING"]
    assert refused == firsts["RESOURCE_EXHAUSTED"]
    assert "Traceback" not in log
