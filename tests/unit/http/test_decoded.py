"""The engine process serves a call its front decoded without ASGI (``nograd.http.decoded``):
what the client gets, once the front encodes it, is what the whole app answers for the same
request, refusals included; a client that leaves cuts the call."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from nograd.bridge.frames import ANSWER
from nograd.front.app import _encoded
from nograd.front.decoding import decodable, decoded_call, predecode
from nograd.http.app import build_app, build_decoded_calls
from nograd.http.connections import STARTED_KEY
from nograd.serving.core import Core
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES

KEY = "unit-decoded-key-0123456789"
Event = MutableMapping[str, Any]
GOOD = {"id": "r1", "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
WRONG = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    repo = tmp_path / "repo"
    for name in ("poison", "slow"):
        shutil.copytree(FIXTURES / name, repo / name)
    settings = Settings(
        model_repository=repo,
        warmup=False,
        api_keys=KEY,
        max_requests_in_flight=4,
        max_request_bytes=4096,
    )
    core = Core(settings)
    await core.open()
    await core.load()
    try:
        yield core
    finally:
        await core.close()


def request(
    model: str, document: dict[str, Any], *headers: tuple[bytes, bytes], key: str | None = KEY
) -> tuple[dict[str, Any], bytes]:
    body = orjson.dumps(document)
    listed = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if key is not None:
        listed.append((b"authorization", f"Bearer {key}".encode()))
    path = f"/v2/models/{model}/infer"
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [*listed, *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {STARTED_KEY: time.perf_counter()},
    }
    return scope, body


def without_request_id(sent: list[Event]) -> list[Event]:
    for event in sent:
        if event["type"] == "http.response.start":
            event["headers"] = [(k, v) for k, v in event["headers"] if k != b"x-request-id"]
    return sent


async def whole_app(core: Core, scope: dict[str, Any], body: bytes) -> list[Event]:
    """What a single server's app sends for the request."""
    sent: list[Event] = []
    events = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Event:
        if events:
            return events.pop()
        await asyncio.Event().wait()  # the client stays until it is answered
        raise AssertionError("unreachable")

    async def send(event: Event) -> None:
        sent.append(event)

    await build_app(core)({**scope, "state": dict(scope["state"])}, receive, send)
    return sent


async def decoded(
    core: Core, scope: dict[str, Any], body: bytes, left: asyncio.Event | None = None
) -> list[Event]:
    """What the client of a front gets for the request served decoded by the engine: the
    engine's events, an answer encoded as the front encodes it."""
    target = decodable(scope)
    predecoded = predecode(scope, body, 1 << 20)
    assert target is not None and predecoded is not None
    call = tuple(decoded_call(scope, target, len(body), predecoded))
    engine: list[Event] = []

    async def send(event: Event) -> None:
        engine.append(event)

    serving = asyncio.create_task(
        build_decoded_calls(core)(call, send, lambda: left is not None and left.is_set())
    )
    if left is not None:
        await left.wait()
        serving.cancel()  # as the bridge's host does when the front says the client left
    await serving
    if engine[0]["type"] != ANSWER:
        return engine
    sent: list[Event] = []

    async def relay(event: Event) -> None:
        sent.append(event)

    await _encoded(scope, engine[0], relay)
    return sent


@pytest.mark.parametrize(
    ("model", "document", "headers", "key", "status"),
    [
        ("poison", GOOD, (), KEY, 200),
        ("poison", GOOD, ((b"accept-encoding", b"gzip"),), KEY, 200),
        ("poison", WRONG, (), KEY, 400),
        ("poison", GOOD, ((b"x-request-timeout", b"soon"),), KEY, 400),
        ("poison", GOOD, (), None, 401),
        ("poison", GOOD, (), "not-the-key", 401),
        ("nope", GOOD, (), KEY, 404),
        ("poison", {**GOOD, "padding": "x" * 4096}, (), KEY, 413),
    ],
    ids=["ok", "gzip", "wrong-shape", "bad-timeout", "no-key", "wrong-key", "unknown", "large"],
)
async def test_a_decoded_call_gets_what_the_whole_app_answers(
    core: Core,
    model: str,
    document: dict[str, Any],
    headers: tuple[tuple[bytes, bytes], ...],
    key: str | None,
    status: int,
) -> None:
    scope, body = request(model, document, *headers, key=key)
    lean = without_request_id(await decoded(core, scope, body))
    whole = without_request_id(await whole_app(core, scope, body))
    assert lean == whole
    assert lean[0]["status"] == status, lean


async def test_the_clients_request_id_comes_back(core: Core) -> None:
    scope, body = request("poison", GOOD, (b"x-request-id", b"abc-123"))
    sent = await decoded(core, scope, body)
    assert (b"x-request-id", b"abc-123") in sent[0]["headers"]


async def test_a_decoded_call_over_the_in_flight_bound_is_refused_as_the_whole_app_does(
    core: Core,
) -> None:
    scope, body = request("poison", GOOD)
    for _ in range(4):  # every place NOGRAD_MAX_REQUESTS_IN_FLIGHT allows
        core.calls.admit("poison", None)
    try:
        lean = await decoded(core, scope, body)
        whole = await whole_app(core, scope, body)
    finally:
        for _ in range(4):
            core.calls.release()
    assert lean == whole
    assert lean[0]["status"] == 503
    assert any(name.lower() == b"retry-after" for name, _ in lean[0]["headers"])


async def test_a_client_that_leaves_cuts_its_call_before_its_batch_runs(core: Core) -> None:
    document = {"inputs": [{"name": "x", "shape": [2, 1], "datatype": "FP32", "data": [1, 2]}]}
    ahead = [asyncio.create_task(decoded(core, *request("slow", document))) for _ in range(2)]
    await asyncio.sleep(0.02)  # the first batch (100 ms) runs; the second waits behind it
    left = asyncio.Event()
    leaving = asyncio.create_task(decoded(core, *request("slow", document), left=left))
    await asyncio.sleep(0.02)
    started = time.perf_counter()
    left.set()
    sent = await asyncio.wait_for(leaving, 1)
    assert time.perf_counter() - started < 0.05  # not after the batches ahead
    assert sent[0]["status"] == 499  # recorded as a client gone, never sent to one
    assert core.plane.admission.in_flight == 2
    for answered in await asyncio.gather(*ahead):
        assert answered[0]["status"] == 200
    assert core.plane.admission.in_flight == 0
