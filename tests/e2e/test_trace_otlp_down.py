"""An OTLP collector that is down (nothing listens) or hung (connections accepted, never
answered): traced requests are answered as fast as untraced ones, the spans waiting for the
collector stay within ``NOGRAD_OTLP_MAX_QUEUE_SIZE``, and the server stops within its drain time
plus the exporter's bounded shutdown."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import free_port, run_server
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

SIMPLE = {
    "inputs": [
        {"name": name, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}
        for name in ("INPUT0", "INPUT1")
    ]
}
BURST = 120
DRAIN_S = 2.0
OTLP_TIMEOUT_S = 2.0


@pytest.fixture
def hung_collector() -> Iterator[str]:
    """A port that completes TCP handshakes (its backlog) and never reads nor answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"
    finally:
        listener.close()


async def _burst(url: str, count: int) -> float:
    """``count`` requests, 16 at a time; each answered 200; the slowest one's seconds."""
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one() -> float:
            started = time.perf_counter()
            answer = await client.post("/v2/models/simple/infer", json=SIMPLE)
            assert answer.status_code == 200, answer.text
            return time.perf_counter() - started

        return max(await asyncio.gather(*(one() for _ in range(count))))


def _set_level(url: str, level: str) -> None:
    answer = httpx.post(f"{url}/v2/trace/setting", json={"trace_level": [level]}, timeout=10)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    "collector",
    # Both take a server's start and four bursts; the normal suite runs the closed port's.
    ["closed", pytest.param("hung", marks=pytest.mark.slow)],
)
def test_a_collector_down_or_hung_costs_no_request_and_no_stop_time(
    tmp_path: Path, collector: str, request: pytest.FixtureRequest
) -> None:
    endpoint = (
        f"http://127.0.0.1:{free_port()}/v1/traces"
        if collector == "closed"
        else request.getfixturevalue("hung_collector")
    )
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_TRACE_MODE": "opentelemetry",
        "NOGRAD_OTLP_ENDPOINT": endpoint,
        "NOGRAD_OTLP_EXPORT_DELAY_MS": "50",
        "NOGRAD_OTLP_MAX_QUEUE_SIZE": "64",
        "NOGRAD_OTLP_TIMEOUT_S": str(OTLP_TIMEOUT_S),
        "NOGRAD_TRACE_RATE": "1",
        "NOGRAD_DRAIN_TIMEOUT_S": str(DRAIN_S),
    }
    with run_server(tmp_path, env=env, ready_timeout_s=120) as server:
        asyncio.run(_burst(server.url, 32))  # warm
        untraced = asyncio.run(_burst(server.url, BURST))
        _set_level(server.url, "TIMESTAMPS")
        # Every request traced: 3 spans each, far more than the queue holds.
        traced = asyncio.run(_burst(server.url, BURST))
        traced_again = asyncio.run(_burst(server.url, BURST))
        assert max(traced, traced_again) < 3 * untraced + 1.0, (untraced, traced, traced_again)
        log = server.log()
        # Spans over the bound are dropped (memory stays bounded), and said so a bounded number
        # of times, not once per span.
        assert 1 <= log.count("Queue full") <= 5, log[-3000:]

        # Stopping while spans wait for a collector that will not take them.
        _set_level(server.url, "TIMESTAMPS")
        asyncio.run(_burst(server.url, 50))
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        stopped_in = time.monotonic() - started
    assert stopped_in < DRAIN_S + OTLP_TIMEOUT_S + 3.0, stopped_in
