"""The FastAPI inference routes, the path a request takes when ``DirectRoutes`` is not in front of
them (an app that mounts nograd's routers itself): the same answers, ids and errors as the direct
layer gives."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp

from nograd.http import openai, v2
from nograd.http.direct import DirectRoutes
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.dataplane import DataPlane
from tests.unit.conftest import count_lookups_and_checks, plane_for


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[DataPlane]:
    plane = plane_for(tmp_path, "poison")
    plane.discover()
    await plane.load_all()
    yield plane
    await plane.stop(0)


def routers_only(plane: DataPlane) -> FastAPI:
    app = FastAPI()
    app.state.dataplane = plane
    app.state.metrics = plane.metrics
    app.state.calls = Calls(plane, plane.metrics, ())
    app.include_router(v2.router)
    app.include_router(openai.router)
    return app


async def post(app: ASGIApp, path: str, body: Any, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        return await client.post(path, json=body, headers=headers)


INFER = {
    "id": "q-1",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}],
}


async def test_the_routes_and_the_direct_routes_give_the_same_answer(plane: DataPlane) -> None:
    routed = routers_only(plane)
    direct = DirectRoutes(routers_only(plane), routers_only(plane).state.calls)
    answers = [await post(app, "/v2/models/poison/infer", INFER) for app in (routed, direct)]
    for answer in answers:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["x-request-id"] == "q-1"  # the V2 id, no header sent
    assert answers[0].json() == answers[1].json()
    assert answers[0].json()["outputs"][0]["data"] == [2.0, 4.0]


async def test_the_routes_answer_errors_in_each_protocol_s_shape(plane: DataPlane) -> None:
    app = routers_only(plane)
    missing = await post(app, "/v2/models/absent/infer", INFER, **{"X-Request-ID": "r-9"})
    assert missing.status_code == 404 and "absent" in missing.json()["error"]
    assert missing.headers["x-request-id"] == "r-9"
    embeddings = await post(app, "/v1/embeddings", {"model": "absent", "input": "hello"})
    assert embeddings.status_code == 404
    assert embeddings.json()["error"]["param"] == "model"
    assert len(embeddings.headers["x-request-id"]) == 32


async def test_an_inference_looks_its_model_up_once_and_checks_its_inputs_once(
    plane: DataPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version a request names is found once and held until it is answered; the inputs it
    declares are checked once, before they are decoded (not again on the decoded arrays)."""
    lookups, checks = count_lookups_and_checks(monkeypatch, plane)
    direct = DirectRoutes(routers_only(plane), routers_only(plane).state.calls)
    for app in (routers_only(plane), direct):
        lookups.clear()
        checks.clear()
        answer = await post(app, "/v2/models/poison/infer", INFER)
        assert answer.status_code == 200
        assert (lookups, checks) == (["poison"], ["poison"])
        wrong = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
        refused = await post(app, "/v2/models/poison/infer", wrong)
        assert refused.status_code == 400 and "unexpected shape for input 'x'" in refused.text
        assert plane.get("poison").active == 0  # every version held is given back


async def test_a_timeout_parameter_that_is_no_duration_is_refused(plane: DataPlane) -> None:
    app = routers_only(plane)
    body = {**INFER, "parameters": {"timeout": -1}}
    answer = await post(app, "/v2/models/poison/infer", body)
    assert answer.status_code == 400
    assert (
        answer.json()["error"] == "parameter 'timeout' must be a non-negative integer (µs), got -1"
    )
