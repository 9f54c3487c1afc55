"""The connection guard driven by hand: bytes fed to the protocol as a socket would, a transport
that records what is written, short timeouts on the running loop."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from nograd.http.connections import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    HEADER_TOO_LARGE,
    JOIN_LIMIT_BYTES,
    TOO_MANY_CONNECTIONS,
    ConnectionGuard,
    ConnectionLimits,
    GuardedProtocol,
    fit_file_limit,
    guarded_protocol,
    head_size,
    refusal,
)
from nograd.settings import Settings

TIMEOUT_S = 0.05
LIMITS = ConnectionLimits(
    header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_header_bytes=1024, max_connections=2
)
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class Transport(asyncio.Transport):
    """Records what the protocol writes; closing tells the protocol as a real one would."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True
        self.protocol: asyncio.BaseProtocol | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data
        self.writes.append(bytes(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            assert self.protocol is not None
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name)


async def echo_body(scope: Any, receive: Any, send: Any) -> None:
    """Answers 200 with the request body once it is whole."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Harness:
    def __init__(self, app: Any = echo_body) -> None:
        self.refusals: list[str] = []
        self.guard = ConnectionGuard(LIMITS, self.refusals.append)
        self.protocol_class = guarded_protocol(self.guard)
        self.config = uvicorn.Config(app, log_config=None, timeout_keep_alive=60)
        self.state = ServerState()

    def connect(self) -> tuple[GuardedProtocol, Transport]:
        protocol = self.protocol_class(config=self.config, server_state=self.state, app_state={})
        transport = Transport()
        transport.protocol = protocol
        protocol.connection_made(transport)
        return protocol, transport


@pytest.fixture
def harness() -> Iterator[Harness]:
    yield Harness()


def status_of(written: bytes | bytearray) -> int:
    return int(bytes(written).split(b" ", 2)[1]) if written else 0


async def settle(seconds: float = 0.0) -> None:
    await asyncio.sleep(seconds)
    for _ in range(5):  # the app's task and the callbacks it schedules
        await asyncio.sleep(0)


async def test_a_silent_connection_gets_408_after_the_header_timeout(harness: Harness) -> None:
    _, transport = harness.connect()
    await settle(TIMEOUT_S * 2)
    assert status_of(transport.written) == 408 and transport.closed
    assert b'{"error":"request headers not received in time"}' in transport.written
    assert harness.refusals == [HEADER_TIMEOUT]


async def test_a_head_sent_slowly_is_cut_at_the_timeout_however_steady(harness: Harness) -> None:
    protocol, transport = harness.connect()
    for byte in GET[:-2]:
        protocol.data_received(bytes([byte]))
        await asyncio.sleep(TIMEOUT_S / 10)
        if transport.closed:
            break
    assert status_of(transport.written) == 408 and transport.closed


async def test_keep_alive_requests_rearm_the_timer_from_their_first_byte(harness: Harness) -> None:
    protocol, transport = harness.connect()
    for _ in range(4):  # idle longer than the header timeout between requests: not cut
        protocol.data_received(GET)
        await settle(TIMEOUT_S * 1.5)
    assert transport.written.count(b"HTTP/1.1 200") == 4 and not transport.closed
    protocol.data_received(GET[:5])  # a later head that never completes is cut
    await settle(TIMEOUT_S * 2)
    assert status_of(transport.written[transport.written.rfind(b"HTTP/1.1") :]) == 408
    assert transport.closed and harness.refusals == [HEADER_TIMEOUT]


async def test_a_head_over_the_limit_gets_431_before_it_completes(harness: Harness) -> None:
    protocol, transport = harness.connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 1100)
    assert status_of(transport.written) == 431 and transport.closed
    assert harness.refusals == [HEADER_TOO_LARGE]


async def test_a_head_over_the_limit_in_one_read_gets_431(harness: Harness) -> None:
    protocol, transport = harness.connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 1100 + b"\r\n\r\n")
    await settle()
    assert status_of(transport.written) == 431 and transport.closed
    assert harness.refusals == [HEADER_TOO_LARGE]


async def test_a_large_head_pipelined_after_a_body_is_measured_exactly(harness: Harness) -> None:
    protocol, transport = harness.connect()
    post = b"POST / HTTP/1.1\r\nContent-Length: 2000\r\n\r\n" + b"b" * 2000
    small = b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 500 + b"\r\n\r\n"
    protocol.data_received(post + small)  # one read of 2,600 bytes, both heads under 1 KiB
    await settle()
    assert transport.written.count(b"HTTP/1.1 200") == 2 and not transport.closed
    large = b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 1100 + b"\r\n\r\n"
    protocol.data_received(post + large)
    await settle()
    assert transport.written.count(b"HTTP/1.1 431") == 1 and transport.closed


async def test_a_head_just_under_the_limit_is_served(harness: Harness) -> None:
    protocol, transport = harness.connect()
    head = b"GET / HTTP/1.1\r\nX-Pad: "
    pad = 1024 - head_size(b"GET", b"/", [(b"x-pad", b"")])
    protocol.data_received(head + b"a" * pad + b"\r\n\r\n")
    await settle()
    assert status_of(transport.written) == 200 and harness.refusals == []


async def test_a_body_pausing_past_the_timeout_gets_408(harness: Harness) -> None:
    protocol, transport = harness.connect()
    protocol.data_received(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nab")
    await settle(TIMEOUT_S * 3)
    assert status_of(transport.written) == 408 and transport.closed
    assert harness.refusals == [BODY_TIMEOUT]


async def test_a_body_with_short_pauses_is_served_however_long_it_takes(harness: Harness) -> None:
    protocol, transport = harness.connect()
    protocol.data_received(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n")
    for _ in range(10):
        await asyncio.sleep(TIMEOUT_S / 2)
        protocol.data_received(b"x")
    await settle()
    assert status_of(transport.written) == 200 and transport.written.endswith(b"x" * 10)
    assert harness.refusals == []


async def test_a_pause_while_nograd_is_not_reading_is_not_the_clients() -> None:
    gate = asyncio.Event()

    async def busy_then_echo(scope: Any, receive: Any, send: Any) -> None:
        await gate.wait()  # e.g. waiting for admission before it reads the body
        await echo_body(scope, receive, send)

    harness = Harness(app=busy_then_echo)
    protocol, transport = harness.connect()
    size = 100_000
    protocol.data_received(f"POST / HTTP/1.1\r\nContent-Length: {size}\r\n\r\n".encode())
    protocol.data_received(b"a" * 70_000)  # past uvicorn's buffer: it stops reading
    assert not transport.reading
    await settle(TIMEOUT_S * 3)
    assert not transport.closed and harness.refusals == []
    gate.set()
    await settle()
    assert transport.reading
    protocol.data_received(b"a" * (size - 70_000))
    await settle()
    assert status_of(transport.written) == 200 and harness.refusals == []


async def test_a_connection_over_the_cap_gets_503_without_being_read(harness: Harness) -> None:
    first, _ = harness.connect()
    harness.connect()
    protocol, transport = harness.connect()
    assert transport.closed and status_of(transport.written) == 503
    assert b"\r\nretry-after: 1\r\n" in transport.written
    assert protocol not in harness.state.connections and len(harness.state.connections) == 2
    assert harness.refusals == [TOO_MANY_CONNECTIONS]
    await settle()  # its connection_lost runs as for any other
    first.connection_lost(None)
    _, fourth = harness.connect()
    assert not fourth.closed


async def test_once_draining_every_response_ends_its_connection(harness: Harness) -> None:
    """What a stop asks of each connection: the response under way and every later one carry
    ``Connection: close``, and a connection kept alive from before waits for its client's next
    request instead of being counted as done."""
    idle, idle_transport = harness.connect()
    idle.data_received(GET)
    await settle()
    assert b"connection: close" not in idle_transport.written  # kept alive
    busy, busy_transport = harness.connect()
    busy.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
    await settle()
    harness.guard.draining = True  # as HttpFront.begin_drain does, with each connection
    for protocol in (idle, busy):
        protocol.begin_drain()
    assert idle.expecting_request  # its client may be sending the next request now
    busy.data_received(b"cd")
    await settle()
    assert b"connection: close" in busy_transport.written and busy_transport.closed
    idle.data_received(GET)
    await settle()
    assert idle_transport.written.count(b"HTTP/1.1 200 OK") == 2
    assert idle_transport.closed
    assert b"connection: close" in idle_transport.written
    assert not idle.expecting_request


def test_refusal_is_a_whole_response_that_closes() -> None:
    response = refusal(408, "late", [(b"server", b"s")], [(b"retry-after", b"1")])
    head, body = response.split(b"\r\n\r\n")
    assert head.split(b"\r\n") == [
        b"HTTP/1.1 408 Request Timeout",
        b"server: s",
        b"retry-after: 1",
        b"content-type: application/json",
        b"content-length: 16",
        b"connection: close",
    ]
    assert body == b'{"error":"late"}'


def test_head_size_counts_the_request_line_and_header_lines() -> None:
    raw = b"GET /x?y=1 HTTP/1.1\r\nHost: a\r\nX-B: cd\r\n\r\n"
    assert head_size(b"GET", b"/x?y=1", [(b"host", b"a"), (b"x-b", b"cd")]) == len(raw)


def test_limits_come_from_the_settings() -> None:
    settings = Settings(header_timeout_s=2, body_timeout_s=3, max_header_bytes=4096)
    limits = ConnectionLimits.from_settings(settings)
    assert limits == ConnectionLimits(2, 3, 4096, settings.max_connections)


@pytest.mark.parametrize(
    ("soft", "hard", "raised"),
    [(1024, 4096, 1024 + 256), (1024, 1100, 1100), (65536, 65536, None)],
)
def test_the_open_file_limit_is_raised_to_fit_the_cap(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, raised: int | None
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    fit_file_limit(1024)
    assert calls == ([] if raised is None else [(raised, hard)])


def post(body: bytes, *, close: bool = False) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    head = b"POST / HTTP/1.1\r\nHost: x\r\n" + connection
    return head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


async def test_a_small_answer_leaves_in_one_write(harness: Harness) -> None:
    """Head and body of an answer written apart by uvicorn leave together: one send, one packet."""
    protocol, transport = harness.connect()
    protocol.data_received(post(b"x" * 100))
    await settle()
    assert len(transport.writes) == 1
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.writes[0].endswith(b"\r\n\r\n" + b"x" * 100)
    # Two requests of one read: each answer as its own write, in order.
    protocol.data_received(post(b"a") + post(b"b"))
    await settle()
    assert [w[-1:] for w in transport.writes[1:]] == [b"a", b"b"]


async def test_a_large_body_is_written_at_once_after_its_head(harness: Harness) -> None:
    protocol, transport = harness.connect()
    body = b"y" * (JOIN_LIMIT_BYTES + 1)
    protocol.data_received(post(body))
    await settle()
    assert len(transport.writes) == 2
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK") and transport.writes[1] == body


async def test_an_answer_that_ends_its_connection_is_written_whole_before_the_close(
    harness: Harness,
) -> None:
    protocol, transport = harness.connect()
    protocol.data_received(post(b"last", close=True))
    await settle()
    assert transport.closed
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"last")
    assert b"connection: close" in transport.writes[0].lower()
