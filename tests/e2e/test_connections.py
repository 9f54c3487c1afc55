"""Slow clients and connection limits against real servers, one process and two workers: heads
sent a byte at a time (slowloris), bodies trickled in, huge headers, more connections than the
cap, and a keep-alive client that must never be cut."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.serving import Server, metric_value, run_server

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 64
"""Per process; a worker of two has its own."""
INFER = "/v2/models/slow/infer"
ONE_ROW = b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[1.0]}]}'


@dataclass
class Guarded:
    server: Server
    processes: int
    """Server processes, each with its own connection cap."""

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-workers"])
def guarded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guarded]:
    root = tmp_path_factory.mktemp("connections")
    repo = root / "repo"
    shutil.copytree(FIXTURES / "slow", repo / "slow")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_WORKERS": str(request.param),
        "NOGRAD_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "NOGRAD_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "NOGRAD_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    with run_server(root, env) as server:
        yield Guarded(server, request.param)


def address(server: Guarded) -> tuple[str, int]:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def rejected(server: Guarded, reason: str) -> float:
    return metric_value(server.url, "nograd_rejected_total", model="_unknown", reason=reason)


async def trickle(
    server: Guarded, head: bytes, body: bytes, every_s: float, limit_s: float
) -> tuple[bytes, float]:
    """Send ``head`` and then ``body`` one byte per ``every_s`` (the head too, if ``body`` is
    empty), stopping once the server answers or closes; the answer and the seconds it took."""
    # Timed from before the connection opens: the server's timers cannot start earlier, so a
    # slow client loop never makes the server look early.
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(*address(server))
    answer = asyncio.ensure_future(reader.read())  # until the server closes
    pieces = [head[i : i + 1] for i in range(len(head))] if not body else [head]
    pieces += [body[i : i + 1] for i in range(len(body))]
    try:
        for piece in pieces:
            if answer.done() or time.monotonic() - started > limit_s:
                break
            writer.write(piece)
            await writer.drain()
            await asyncio.wait([answer], timeout=every_s)
    except ConnectionError:
        pass  # closed by the server: its answer, if any, is read below
    await asyncio.wait([answer], timeout=max(0.1, limit_s - (time.monotonic() - started)))
    seconds = time.monotonic() - started
    data = answer.result() if answer.done() and answer.exception() is None else b""
    answer.cancel()
    writer.close()
    return data, seconds


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, TimeoutError):
        pass
    return b"".join(chunks)


async def test_slowloris_heads_get_408_while_a_normal_client_is_served(guarded: Guarded) -> None:
    head = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    attack = [
        asyncio.ensure_future(trickle(guarded, head, b"", every_s=0.3, limit_s=5.0))
        for _ in range(50)
    ]
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=guarded.url, timeout=5) as client:
        while not all(task.done() for task in attack):
            started = time.monotonic()
            ready = await client.get("/v2/health/ready")
            fresh = await client.post(INFER, content=ONE_ROW, headers={"Connection": "close"})
            latencies.append(time.monotonic() - started)
            assert ready.status_code == 200 and fresh.status_code == 200, fresh.text
            await asyncio.sleep(0.05)
    for answer, seconds in await asyncio.gather(*attack):
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert HEADER_TIMEOUT_S * 0.9 <= seconds < HEADER_TIMEOUT_S + 1.5
    assert len(latencies) >= 5 and max(latencies) < 0.75, latencies
    assert rejected(guarded, "header_timeout") >= 50


async def test_a_body_at_one_byte_a_second_gets_408(guarded: Guarded) -> None:
    # Connection: close, so the answer ends the exchange rather than the keep-alive timeout.
    head = (
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(ONE_ROW)}\r\nConnection: close\r\n\r\n"
    ).encode()
    answer, seconds = await trickle(guarded, head, ONE_ROW, every_s=1.0, limit_s=5.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert BODY_TIMEOUT_S * 0.9 <= seconds < BODY_TIMEOUT_S + 1.5
    # Pauses shorter than the timeout are fine, however long the body takes in all.
    answer, seconds = await trickle(guarded, head, ONE_ROW, every_s=0.05, limit_s=10.0)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert seconds > BODY_TIMEOUT_S * 2
    assert rejected(guarded, "body_timeout") >= 1


def test_a_megabyte_header_gets_431(guarded: Guarded) -> None:
    huge = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    huge += b"a" * (1 << 20) + b"\r\n\r\n"
    with socket.create_connection(address(guarded)) as sock:
        # The server answers and closes before it has read it all: send from a thread.
        sender = threading.Thread(target=lambda: _send_ignoring_reset(sock, huge), daemon=True)
        sender.start()
        answer = read_until_closed(sock, timeout_s=5)
        sender.join(5)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    # A head under the limit (32 KiB by default) is served as usual.
    padded = httpx.get(f"{guarded.url}/v2/health/ready", headers={"X-Padding": "a" * 20_000})
    assert padded.status_code == 200
    assert rejected(guarded, "header_too_large") >= 1


def _send_ignoring_reset(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def test_connections_over_the_cap_get_503_at_once(guarded: Guarded) -> None:
    cap = MAX_CONNECTIONS * guarded.processes
    held = [socket.create_connection(address(guarded)) for _ in range(cap)]
    try:
        time.sleep(0.2)  # every one of them accepted and served before the next arrive
        started = time.monotonic()
        extra = [socket.create_connection(address(guarded)) for _ in range(3)]
        answers = [read_until_closed(sock, timeout_s=5) for sock in extra]
        seconds = time.monotonic() - started
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
            assert b"\r\nretry-after: 1\r\n" in answer.lower()
        assert seconds < HEADER_TIMEOUT_S / 2
        # The connections held, silent, are closed with 408 after the header timeout.
        for sock in held[:3]:
            assert read_until_closed(sock, timeout_s=5).startswith(b"HTTP/1.1 408")
    finally:
        for sock in held:
            sock.close()
    assert httpx.get(f"{guarded.url}/v2/health/ready").status_code == 200
    assert rejected(guarded, "too_many_connections") >= 3


def test_a_keep_alive_client_outlasting_the_header_timeout_is_not_cut(guarded: Guarded) -> None:
    host, port = address(guarded)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/v2/health/ready")
        first_socket = conn.sock
        conn.getresponse().read()
        started = time.monotonic()
        while time.monotonic() - started < HEADER_TIMEOUT_S * 3:
            time.sleep(0.2)
            conn.request("POST", INFER, body=ONE_ROW, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            assert conn.sock is first_socket, "the connection was closed and opened again"
    finally:
        conn.close()
