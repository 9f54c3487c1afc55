"""The bridge between front processes and the engine, both ends in one event loop over a real
Unix socket: frames split anywhere, a call's events relayed both ways, a client leaving, the
engine away or gone mid-call (503 at once), an app that fails (500), writes coalesced."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncIterator, Callable, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from nograd.bridge.frames import HEADER, MAX_FRAME_BYTES, FrameError, FrameReader, Outbox, frame
from nograd.bridge.host import BridgeHost
from nograd.bridge.link import EngineLink, LinkDown
from nograd.front.app import ENGINE_AWAY, ForwardingApp
from nograd.http.connections import STARTED_KEY
from nograd.serving.calls.access import Access
from tests.unit.bridge.recording import Transport

Event = MutableMapping[str, Any]


def test_frames_split_anywhere_come_out_whole() -> None:
    events = [(1, {"type": "a", "body": b"x" * 1000}), (7, ({"path": "/"}, {"type": "b"}))]
    wire = b"".join(frame(stream, payload) for stream, payload in events)
    for chunk in (1, 3, 17, len(wire)):
        reader = FrameReader()
        got = []
        for start in range(0, len(wire), chunk):
            got += reader.feed(wire[start : start + chunk])
        assert got == events


def test_a_frame_longer_than_any_is_refused() -> None:
    with pytest.raises(FrameError):
        FrameReader().feed(HEADER.pack(1, MAX_FRAME_BYTES) + b"x")


async def test_the_frames_of_one_turn_leave_in_one_write() -> None:
    transport = Transport()
    outbox = Outbox(transport)  # type: ignore[arg-type]
    for stream in range(50):
        outbox.put(frame(stream, {"type": "x"}))
    await asyncio.sleep(0)
    assert len(transport.writes) == 1
    assert [s for s, _ in FrameReader().feed(transport.writes[0])] == list(range(50))


async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """Echoes the body in two chunks with what it saw of the scope; ``/wait`` answers once its
    client has left; ``/fail`` raises before answering."""
    if scope["path"] == "/fail":
        raise RuntimeError("broken")
    body = b""
    while True:
        event = await receive()
        body += event.get("body", b"")
        if not event.get("more_body", False):
            break
    if scope["path"] == "/wait":
        left = await receive()
        seen.append(left["type"])
        return
    seen.append(scope["state"].get(STARTED_KEY))
    headers = [[name.decode(), value.decode()] for name, value in scope["headers"]]
    head = {"path": scope["path"], "method": scope["method"], "headers": headers}
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
    await send({"type": "http.response.body", "body": orjson.dumps(head), "more_body": True})
    await send({"type": "http.response.body", "body": body})


seen: list[Any] = []


@pytest.fixture
async def bridge(tmp_path: Path) -> AsyncIterator[tuple[BridgeHost, EngineLink]]:
    seen.clear()
    host = BridgeHost(app, tmp_path / "engine.sock")
    await host.start()
    link = EngineLink(tmp_path / "engine.sock")
    linking = asyncio.create_task(link.run())
    assert await wait_connected(link, 5)
    yield host, link
    link.close()
    linking.cancel()
    await host.stop()


async def wait_connected(link: EngineLink, timeout_s: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(link.connected.wait(), timeout_s)
    return link.up


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 5 s")


def forwarding(link: EngineLink) -> ForwardingApp:
    return ForwardingApp(link, 1 << 20, Access(()))


def scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"host", b"x")],
        "state": {STARTED_KEY: 12.5},
        "app": object(),  # not carried: only what the engine's app reads
    }


async def call(link: EngineLink, path: str, chunks: list[bytes]) -> list[Event]:
    incoming: asyncio.Queue[Event] = asyncio.Queue()
    for index, chunk in enumerate(chunks):
        incoming.put_nowait(
            {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
        )
    sent: list[Event] = []

    async def send(event: Event) -> None:
        sent.append(event)

    await asyncio.wait_for(forwarding(link)(scope(path), incoming.get, send), 5)
    return sent


async def test_a_call_crosses_with_its_body_and_comes_back_whole(
    bridge: tuple[BridgeHost, EngineLink],
) -> None:
    host, link = bridge
    sent = await call(link, "/echo", [b"ab", b"", b"cd"])
    assert [e["type"] for e in sent] == ["http.response.start", *["http.response.body"] * 2]
    assert sent[0]["status"] == 201 and sent[0]["headers"] == [(b"x-a", b"1")]
    head = orjson.loads(sent[1]["body"])
    assert head == {"path": "/echo", "method": "POST", "headers": [["host", "x"]]}
    assert sent[2]["body"] == b"abcd"
    assert seen == [12.5]  # the arrival time the front's connection stamped
    assert host.open_streams == 0 and link.open_streams == 0


async def test_many_calls_at_once_keep_their_own_answers(
    bridge: tuple[BridgeHost, EngineLink],
) -> None:
    _, link = bridge
    answers = await asyncio.gather(*(call(link, f"/{i}", [str(i).encode()]) for i in range(64)))
    assert [a[2]["body"] for a in answers] == [str(i).encode() for i in range(64)]


async def test_a_client_that_leaves_is_seen_leaving_by_the_engine(
    bridge: tuple[BridgeHost, EngineLink],
) -> None:
    host, link = bridge
    incoming: asyncio.Queue[Event] = asyncio.Queue()
    incoming.put_nowait({"type": "http.request", "body": b"", "more_body": False})

    async def send(event: Event) -> None:
        raise AssertionError(f"nothing is answered to a client that left: {event}")

    running = asyncio.create_task(forwarding(link)(scope("/wait"), incoming.get, send))
    await until(lambda: host.open_streams == 1)
    incoming.put_nowait({"type": "http.disconnect"})
    await until(lambda: host.open_streams == 0)
    assert seen == ["http.disconnect"]
    running.cancel()


async def test_an_app_that_fails_is_a_500_as_an_asgi_server_answers(
    bridge: tuple[BridgeHost, EngineLink],
) -> None:
    _, link = bridge
    sent = await call(link, "/fail", [b""])
    assert sent[0]["status"] == 500 and sent[1]["body"] == b"Internal Server Error"


async def test_an_engine_away_is_a_503_at_once(tmp_path: Path) -> None:
    link = EngineLink(tmp_path / "nobody.sock")
    with pytest.raises(LinkDown):
        link.open()
    sent = await call(link, "/v2/models/m/infer", [b"{}"])
    assert sent[0]["status"] == 503
    assert any(name == b"retry-after" for name, _ in sent[0]["headers"])
    assert orjson.loads(sent[1]["body"]) == {"error": ENGINE_AWAY}
    openai = await call(link, "/v1/embeddings", [b"{}"])
    assert orjson.loads(openai[1]["body"])["error"]["message"] == ENGINE_AWAY


async def test_an_engine_gone_mid_call_is_a_503_and_the_link_comes_back(
    bridge: tuple[BridgeHost, EngineLink], tmp_path: Path
) -> None:
    host, link = bridge
    incoming: asyncio.Queue[Event] = asyncio.Queue()
    incoming.put_nowait({"type": "http.request", "body": b"", "more_body": False})
    sent: list[Event] = []

    async def send(event: Event) -> None:
        sent.append(event)

    running = asyncio.create_task(forwarding(link)(scope("/wait"), incoming.get, send))
    await until(lambda: host.open_streams == 1)
    await host.stop()  # the engine dies with the call under way
    await asyncio.wait_for(running, 2)
    assert sent[0]["status"] == 503
    # A new engine on the same socket: the link finds it again by itself.
    again = BridgeHost(app, tmp_path / "engine.sock")
    await again.start()
    assert await wait_connected(link, 5)
    assert (await call(link, "/echo", [b"back"]))[2]["body"] == b"back"
    await again.stop()


def test_what_crosses_is_plain_data() -> None:
    """Everything a front sends pickles without its framework's objects."""
    from nograd.front.app import wire_scope

    carried = wire_scope(scope("/x"))
    assert "app" not in carried and carried["state"] == {STARTED_KEY: 12.5}
    assert pickle.loads(pickle.dumps(carried)) == carried
