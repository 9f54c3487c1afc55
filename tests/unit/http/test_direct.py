"""The inference routes served ahead of the router: which requests it claims, which it leaves."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import Response
from starlette.types import Receive, Scope, Send

from nograd.http import direct
from nograd.http.exchange import Incoming
from nograd.http.reply import Reply


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    async def v2(self, incoming: Incoming, calls: Any, name: str, version: str | None) -> Reply:
        assert calls is CALLS
        self.calls.append(("v2", name, str(version), await incoming.body()))  # type: ignore[arg-type]
        return Reply(200, b"v2", "text/plain", [("X-Request-ID", "r-1")])

    async def embeddings(self, incoming: Incoming, calls: Any) -> Reply:
        assert calls is CALLS
        self.calls.append(("openai", (await incoming.body()).decode()))
        return Reply(200, b"openai", "text/plain")

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(("framework", scope["method"], scope["path"]))
        await Response(b"framework", media_type="text/plain")(scope, receive, send)


CALLS = object()
"""A stand-in: the layer hands the call lifecycle it was built with to every call."""


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(direct.v2, "infer_call", recorder.v2)
    monkeypatch.setattr(direct.openai, "embeddings_call", recorder.embeddings)
    return recorder


async def send(recorder: Recorder, method: str, path: str, **kwargs: Any) -> httpx.Response:
    layer = direct.DirectRoutes(recorder.framework, CALLS)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=layer, **kwargs)
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        return await client.request(method, path, content=b"{}")


async def test_infer_paths_are_served_directly(recorder: Recorder) -> None:
    answer = await send(recorder, "POST", "/v2/models/digits/infer")
    assert answer.text == "v2"
    assert answer.headers["x-request-id"] == "r-1"
    assert answer.headers["content-type"] == "text/plain"
    assert answer.headers["content-length"] == "2"
    answer = await send(recorder, "POST", "/v2/models/digits/versions/7/infer")
    assert answer.text == "v2"
    answer = await send(recorder, "POST", "/v1/embeddings")
    assert answer.text == "openai"
    assert recorder.calls == [
        ("v2", "digits", "None", b"{}"),
        ("v2", "digits", "7", b"{}"),
        ("openai", "{}"),
    ]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/models/digits/infer"),  # the router answers 405 for a wrong method
        ("POST", "/v2/models/digits/infer/"),  # and redirects a trailing slash
        ("POST", "/v2/models//infer"),
        ("POST", "/v2/models/a/b/infer"),
        ("GET", "/v2/health/ready"),
        ("POST", "/v1/embeddings/extra"),
    ],
)
async def test_everything_else_goes_to_the_router(
    recorder: Recorder, method: str, path: str
) -> None:
    answer = await send(recorder, method, path)
    assert answer.text == "framework"
    assert recorder.calls == [("framework", method, path)]


async def test_a_proxy_prefix_is_stripped_before_matching(recorder: Recorder) -> None:
    answer = await send(recorder, "POST", "/serving/v2/models/m/infer", root_path="/serving")
    assert answer.text == "v2"
    assert recorder.calls[0][:3] == ("v2", "m", "None")
