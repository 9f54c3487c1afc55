"""Triton's model configuration and repository routes, on a loaded data plane."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from nograd.formats.triton.api.documents import model_configuration
from nograd.http import repository
from nograd.http.app import create_app
from nograd.http.errors import install_error_handlers
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.control.model_control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.serving.registry import State
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES, plane_for


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[DataPlane]:
    plane = plane_for(tmp_path, "poison")
    plane.discover()
    await plane.load_all()
    yield plane
    await plane.stop(0)


@pytest.fixture
def app(plane: DataPlane) -> FastAPI:
    app = FastAPI()
    app.state.dataplane = plane
    app.state.metrics = plane.metrics
    app.state.calls = Calls(plane, plane.metrics, ())
    app.state.control = ModelControl(plane)
    app.include_router(repository.router)
    install_error_handlers(app)
    return app


async def call(app: FastAPI, method: str, path: str, content: bytes = b"") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        return await client.request(method, path, content=content)


async def test_the_configuration_is_triton_s_shape(app: FastAPI, plane: DataPlane) -> None:
    answer = await call(app, "GET", "/v2/models/poison/config")
    assert answer.status_code == 200
    config = answer.json()
    assert config["name"] == "poison"
    assert config["max_batch_size"] == plane.settings.max_request_rows
    assert config["input"] == [
        {
            "name": "x",
            "data_type": "TYPE_FP32",
            "dims": [2],
            "format": "FORMAT_NONE",
            "optional": False,
        }
    ]
    assert config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}]
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 20_000
    assert batching["default_queue_policy"]["max_queue_size"] == plane.settings.max_queue_size
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    batcher = plane.models["poison"].batcher
    assert batcher is not None
    assert config["parameters"]["batch_limit"] == {"string_value": str(batcher.limit.current)}
    versioned = await call(app, "GET", "/v2/models/poison/versions/1/config")
    assert versioned.json() == config


async def test_an_unknown_model_or_version_is_a_404_naming_it(app: FastAPI) -> None:
    for path in ("/v2/models/absent/config", "/v2/models/poison/versions/7/config"):
        answer = await call(app, "GET", path)
        assert answer.status_code == 404
        assert answer.json()["error"] in (
            "Request for unknown model: 'absent' is not found",
            "Request for unknown model: 'poison' version 7 is not found",
        )


async def test_the_index_lists_every_model_with_its_state(app: FastAPI, plane: DataPlane) -> None:
    answer = await call(app, "POST", "/v2/repository/index")
    assert answer.json() == [{"name": "poison", "version": "1", "state": "READY"}]
    plane.models["poison"].state = State.FAILED
    plane.models["poison"].error = "it broke"
    failed = await call(app, "POST", "/v2/repository/index", b'{"ready": false}')
    assert failed.json() == [
        {"name": "poison", "version": "1", "state": "UNAVAILABLE", "reason": "it broke"}
    ]
    assert (await call(app, "POST", "/v2/repository/index", b'{"ready": true}')).json() == []
    plane.models["poison"].state = State.READY


@pytest.mark.parametrize("body", [b"{", b"[1]", b'{"ready": "yes"}'])
async def test_a_malformed_index_request_is_a_400(app: FastAPI, body: bytes) -> None:
    answer = await call(app, "POST", "/v2/repository/index", body)
    assert answer.status_code == 400
    assert answer.json()["error"]


async def test_load_and_unload_say_model_control_is_off(app: FastAPI) -> None:
    for action in ("load", "unload"):
        answer = await call(app, "POST", f"/v2/repository/models/poison/{action}", b"{}")
        assert answer.status_code == 400
        assert "model control is not enabled" in answer.json()["error"]
        missing = await call(app, "POST", f"/v2/repository/models/absent/{action}")
        assert missing.status_code == 404


async def test_a_scalar_input_is_dims_one_reshaped_to_none(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "texts").mkdir(parents=True)
    source = (FIXTURES / "poison" / "config.toml").read_text()
    (repo / "texts" / "config.toml").write_text(
        source.replace('name = "poison"', 'name = "texts"').replace(
            'datatype = "FP32"\nshape = [2]', 'datatype = "BYTES"\nshape = []', 1
        )
    )
    app = create_app(Settings(model_repository=repo, warmup=False))
    plane = app.state.dataplane
    plane.discover()
    config = model_configuration(plane.models["texts"], plane.settings)
    assert config["input"][0]["data_type"] == "TYPE_STRING"
    assert config["input"][0]["dims"] == [1]
    assert config["input"][0]["reshape"] == {"shape": []}
