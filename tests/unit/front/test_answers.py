"""A small V2 inference crosses the bridge decoded: the engine gets the tensors in a decoded
call (no scope, no body), and the answer it leaves unencoded comes out of the front as the bytes
a single server sends, compressed when asked."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from nograd.bridge.frames import DecodedCall
from nograd.bridge.host import BridgeHost
from nograd.bridge.link import EngineLink
from nograd.front.app import ForwardingApp
from nograd.http.reply import Reply, answer_reply
from nograd.protocol.v2 import RequestedOutput
from nograd.protocol.v2_handover import Answer, Predecoded
from nograd.serving.calls.access import Access

Event = MutableMapping[str, Any]
DOCUMENT = {"id": "r1", "inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
ANSWER = Answer(
    "m",
    "1",
    {"y": np.array([3.0, 4.0], dtype=np.float32), "z": np.array([7], dtype=np.int64)},
    (RequestedOutput("y"), RequestedOutput("z", binary=True)),
    "r1",
)
seen: list[tuple[Any, bytes]] = []
NO_KEYS = Access(())


async def engine_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """Records a call that reached the engine as it came; answers as a route refusing it."""
    event = await receive()
    seen.append((None, event.get("body", b"")))
    reply = Reply(400, b'{"error":"x"}')
    reply.headers.append(("X-Request-ID", "abc"))
    await reply.send(send)


async def decoded_app(wire: tuple[Any, ...], send: Any, left: Any) -> None:
    """Records a call its front decoded; answers as the engine's V2 inference does."""
    del left
    seen.append((DecodedCall(*wire), b""))
    reply = Reply(200, answer=ANSWER)
    reply.headers.append(("X-Request-ID", "abc"))
    await reply.send(send)


@pytest.fixture
async def link(tmp_path: Path) -> AsyncIterator[EngineLink]:
    seen.clear()
    host = BridgeHost(engine_app, tmp_path / "engine.sock", decoded_app)
    await host.start()
    link = EngineLink(tmp_path / "engine.sock")
    linking = asyncio.create_task(link.run())
    await asyncio.wait_for(link.connected.wait(), 5)
    yield link
    link.close()
    linking.cancel()
    await host.stop()


async def call(
    link: EngineLink, body: bytes, *headers: tuple[bytes, bytes], access: Access = NO_KEYS
) -> list[Event]:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/m/infer",
        "headers": [(b"content-length", str(len(body)).encode()), *headers],
        "state": {},
    }
    incoming: asyncio.Queue[Event] = asyncio.Queue()
    incoming.put_nowait({"type": "http.request", "body": body, "more_body": False})
    sent: list[Event] = []

    async def send(event: Event) -> None:
        sent.append(event)

    await asyncio.wait_for(ForwardingApp(link, 1 << 20, access)(scope, incoming.get, send), 5)
    return sent


async def test_the_engine_gets_tensors_and_the_front_encodes_the_answer(
    link: EngineLink,
) -> None:
    body = orjson.dumps(DOCUMENT)
    sent = await call(link, body, (b"x-request-id", b"mine"), (b"x-request-id", b"second"))
    decoded, _ = seen[0]
    assert decoded.path == "/v2/models/m/infer"
    assert (decoded.name, decoded.version, decoded.length) == ("m", None, len(body))
    assert decoded.request_id == "mine"  # a header sent twice: its first value, as ASGI reads it
    request = Predecoded.from_wire(decoded.request).request
    np.testing.assert_array_equal(request.inputs["x"], [1.0, 2.0])
    assert request.inputs["x"].flags.writeable  # torch takes it as it is
    expected = answer_reply(ANSWER)
    expected.headers.append(("X-Request-ID", "abc"))
    single: list[Event] = []

    async def keep(event: Event) -> None:
        single.append(event)

    await expected.send(keep)
    assert sent == single
    assert (b"x-request-id", b"abc") in sent[0]["headers"]


async def test_an_answer_asked_compressed_leaves_the_front_compressed(link: EngineLink) -> None:
    sent = await call(link, orjson.dumps(DOCUMENT), (b"accept-encoding", b"gzip"))
    headers = dict(sent[0]["headers"])
    assert headers[b"content-encoding"] == b"gzip"
    assert gzip.decompress(sent[1]["body"]) == answer_reply(ANSWER).body


async def test_a_request_the_front_cannot_decode_reaches_the_engine_as_it_came(
    link: EngineLink,
) -> None:
    sent = await call(link, b"{broken")
    assert seen == [(None, b"{broken")]
    assert sent[0]["status"] == 400


async def test_a_call_without_a_good_key_is_left_to_the_engine_to_refuse(link: EngineLink) -> None:
    keys = Access(["k1"])
    await call(link, orjson.dumps(DOCUMENT), access=keys)
    await call(link, orjson.dumps(DOCUMENT), (b"authorization", b"Bearer nope"), access=keys)
    await call(link, orjson.dumps(DOCUMENT), (b"authorization", b"Bearer k1"), access=keys)
    assert [wire is None for wire, _ in seen] == [True, True, False]
