"""What the app refuses before reading a body (a missing key, overload), and HEAD on GET routes,
driven as raw ASGI so a test sees whether the body was ever read."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from starlette.types import Message

from nograd.http.app import create_app
from nograd.observability.metrics import UNKNOWN_MODEL
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES

KEY = "k-unit-0123456789"
SLOW_ROW = orjson.dumps(
    {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
)


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **settings: Any) -> AsyncIterator[FastAPI]:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "slow", repo / "slow")
    config = repo / "slow" / "config.toml"
    config.write_text(config.read_text().replace("max_queue_size = 4", "max_queue_size = 64"))
    app = create_app(Settings(model_repository=repo, warmup=False, **settings))
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app.state.dataplane.until_loaded(), 30)
        yield app


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.body_reads = 0


async def call(
    app: FastAPI,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes | None = b"",
) -> Answer:
    """One request; ``body`` None: a chunked upload that never ends (reading it hangs)."""
    answer = Answer()
    sent = False

    async def receive() -> Message:
        # As a server does: the body once, then nothing until the client leaves.
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        answer.body_reads += 1
        if body is None:
            return {"type": "http.request", "body": b"x" * 65536, "more_body": True}
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            answer.body += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"nograd"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), 10)
    return answer


async def test_an_unauthenticated_upload_is_refused_before_its_body_is_read(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, api_keys=KEY) as app:
        chunked = [(b"transfer-encoding", b"chunked"), (b"content-type", b"application/json")]
        answer = await call(app, "POST", "/v2/models/slow/infer", chunked, body=None)
        assert answer.status == 401
        assert answer.body_reads == 0
        assert answer.headers["connection"] == "close"  # the rest of the upload is not read
        assert b"missing API key" in answer.body
        rejected = app.state.metrics.rejected.labels("slow", "unauthorized")._value.get()
        assert rejected == 1


async def test_two_authorization_headers_are_refused_even_with_a_valid_key(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, api_keys=KEY) as app:
        valid = (b"authorization", f"Bearer {KEY}".encode())
        other = (b"authorization", b"Bearer something-else")
        for headers in ([valid, other], [other, valid], [valid, valid]):
            answer = await call(app, "POST", "/v2/models/slow/infer", headers, SLOW_ROW)
            assert answer.status == 401, answer.body
            assert b"one 'Authorization" in answer.body
        assert (await call(app, "POST", "/v2/models/slow/infer", [valid], SLOW_ROW)).status == 200


async def test_head_answers_as_get_without_the_body(tmp_path: Path) -> None:
    async with running(tmp_path) as app:
        for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/slow", "/metrics"):
            get = await call(app, "GET", path, [])
            head = await call(app, "HEAD", path, [])
            assert get.status == 200 and get.body
            assert head.status == 200, path
            assert head.body == b""
            assert head.headers.get("content-type") == get.headers.get("content-type")
        assert (await call(app, "HEAD", "/v2/models/absent", [])).status == 404


async def test_requests_over_the_in_flight_bound_get_503_before_their_body_is_read(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, max_requests_in_flight=2) as app:
        # Two uploads that never finish hold the process's two places.
        chunked = [(b"transfer-encoding", b"chunked")]
        holding = [
            asyncio.ensure_future(call(app, "POST", "/v2/models/slow/infer", chunked, None))
            for _ in range(2)
        ]
        await asyncio.sleep(0.05)
        refused = await call(app, "POST", "/v2/models/slow/infer", [], SLOW_ROW)
        assert refused.status == 503
        assert refused.body_reads == 0
        assert refused.headers["retry-after"] == "1"
        assert b"NOGRAD_MAX_REQUESTS_IN_FLIGHT" in refused.body
        embeddings = await call(app, "POST", "/v1/embeddings", [], b"{}")
        assert embeddings.status == 503
        assert orjson.loads(embeddings.body)["error"]["code"] == "server_overloaded"
        metrics = app.state.metrics
        assert metrics.rejected.labels("slow", "in_flight")._value.get() == 1
        assert metrics.rejected.labels(UNKNOWN_MODEL, "in_flight")._value.get() == 1
        # Health and metadata are never refused for load.
        assert (await call(app, "GET", "/v2/health/live", [])).status == 200
        for task in holding:
            task.cancel()
        await asyncio.gather(*holding, return_exceptions=True)
        assert app.state.dataplane.admission.in_flight == 0
        assert (await call(app, "POST", "/v2/models/slow/infer", [], SLOW_ROW)).status == 200


async def test_a_queue_that_would_outlast_the_bound_refuses_before_the_body_is_read(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, max_queue_wait_s=0.3) as app:
        # The slow model runs 100 ms per batch of 2 rows: 20 rows at once are ~1 s of work.
        assert (await call(app, "POST", "/v2/models/slow/infer", [], SLOW_ROW)).status == 200
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def timed() -> tuple[Answer, float]:
            answer = await call(app, "POST", "/v2/models/slow/infer", [], SLOW_ROW)
            return answer, loop.time() - started

        answers = await asyncio.gather(*(timed() for _ in range(20)))
        served = [seconds for answer, seconds in answers if answer.status == 200]
        refused = [(answer, seconds) for answer, seconds in answers if answer.status != 200]
        # Those admitted while the queue was short (answered within the bound: 2 rows at
        # 100 ms a batch) are served; the rest are refused at once.
        assert len(served) >= 2 and refused
        for answer, seconds in refused:
            assert answer.status == 503, answer.body
            assert seconds < 0.1
            assert answer.body_reads == 0
            assert int(answer.headers["retry-after"]) >= 1
            assert b"NOGRAD_MAX_QUEUE_WAIT_S" in answer.body
        # The served were answered about within the bound, not after the whole flood.
        assert max(served) < 0.3 + 0.1 + 0.3
        rejected = app.state.metrics.rejected.labels("slow", "queue_wait")._value.get()
        assert rejected == len(refused)


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_other_methods_on_inference_paths_are_not_admitted(
    tmp_path: Path, method: str
) -> None:
    async with running(tmp_path, max_requests_in_flight=1) as app:
        answer = await call(app, method, "/v2/models/slow/infer", [], SLOW_ROW)
        assert answer.status == 405
        assert app.state.dataplane.admission.in_flight == 0
