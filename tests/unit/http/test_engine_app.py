"""The engine process's app: a call its front decoded skips the framework's layers, not
nograd's own checks; what a client gets is what the whole app answers for the same call."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from nograd.front.decoding import predecode
from nograd.http.app import build_app, build_engine_app
from nograd.http.connections import PREDECODED_KEY, STARTED_KEY
from nograd.serving.core import Core
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES

KEY = "unit-engine-app-key-0123456789"
Event = MutableMapping[str, Any]


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[Core]:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    settings = Settings(model_repository=repo, warmup=False, api_keys=KEY, max_requests_in_flight=1)
    core = Core(settings)
    await core.open()
    await core.load()
    try:
        yield core
    finally:
        await core.close()


def decoded_scope(model: str, document: dict[str, Any], key: str | None) -> dict[str, Any]:
    body = orjson.dumps(document)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
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
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {STARTED_KEY: time.perf_counter()},
    }
    predecoded = predecode(scope, body, 1 << 20)
    assert predecoded is not None
    scope["state"][PREDECODED_KEY] = predecoded.to_wire()
    return scope


async def answer(app: Any, scope: dict[str, Any]) -> list[Event]:
    sent: list[Event] = []
    events = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Event:
        if events:
            return events.pop()
        await asyncio.Event().wait()  # the client stays until it is answered
        raise AssertionError("unreachable")

    async def send(event: Event) -> None:
        sent.append(event)

    await app({**scope, "state": dict(scope["state"])}, receive, send)
    for event in sent:
        if event["type"] == "http.response.start":
            # Each call has its own request id.
            event["headers"] = [(k, v) for k, v in event["headers"] if k != b"x-request-id"]
    return sent


GOOD = {"id": "r1", "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
WRONG = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


@pytest.mark.parametrize(
    ("model", "document", "key", "status"),
    [
        ("poison", GOOD, KEY, 200),
        ("poison", WRONG, KEY, 400),
        ("poison", GOOD, None, 401),
        ("poison", GOOD, "not-the-key", 401),
        ("nope", GOOD, KEY, 404),
    ],
)
async def test_a_decoded_call_gets_what_the_whole_app_answers(
    core: Core, model: str, document: dict[str, Any], key: str | None, status: int
) -> None:
    scope = decoded_scope(model, document, key)
    lean = await answer(build_engine_app(core), scope)
    whole = await answer(build_app(core), scope)
    assert lean == whole
    first = lean[0]
    assert first.get("status", 200) == status, first


async def test_a_decoded_call_over_the_in_flight_bound_is_refused_as_the_whole_app_does(
    core: Core,
) -> None:
    scope = decoded_scope("poison", GOOD, KEY)
    core.calls.admit("poison", None)  # the one place NOGRAD_MAX_REQUESTS_IN_FLIGHT allows
    try:
        lean = await answer(build_engine_app(core), scope)
        whole = await answer(build_app(core), scope)
    finally:
        core.calls.release()
    assert lean == whole
    assert lean[0]["status"] == 503
    assert any(name.lower() == b"retry-after" for name, _ in lean[0]["headers"])
