"""NaN and +/-Inf through the app: refused as inputs (JSON and binary) with a 400 naming the
input, passed through and marked when the model allows them, and never an embedding."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from fastapi import FastAPI

from nograd.http import openai, v2
from nograd.http.direct import DirectRoutes
from nograd.protocol import binary
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.dataplane import DataPlane
from tests.unit.conftest import FIXTURES, plane_for

LENIENT_CONFIG = """
name = "lenient"
weights = ""
reject_non_finite = false
max_batch_size = 8
max_queue_delay_ms = 0
device = "cpu"
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""

EMBEDDER_CONFIG = """
name = "embedder"
weights = ""
max_batch_size = 8
max_queue_delay_ms = 0
device = "cpu"
[[inputs]]
name = "text"
datatype = "BYTES"
shape = []
[[outputs]]
name = "embedding"
datatype = "FP32"
shape = [3]
"""

EMBEDDER_CODE = '''
"""Embeds a text as its number three times ("nan" gives NaN); other texts as their length."""

import numpy as np
import torch

from nograd.sdk import ModelHandler, TensorPart


def _value(text: bytes) -> float:
    try:
        return float(text)
    except ValueError:
        return float(len(text))


class Handler(ModelHandler):
    def prepare(self, inputs):
        values = np.array([_value(t) for t in inputs["text"].reshape(-1)], dtype=np.float32)
        return TensorPart({"value": values.reshape(-1, 1)}, len(values))


class Repeat(torch.nn.Module):
    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value.repeat(1, 3)


def build_handler(model_dir, config, device):
    return Handler(Repeat(), config, device)
'''


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[DataPlane]:
    plane = plane_for(tmp_path, "poison")
    repo = plane.settings.model_repository
    shutil.copytree(FIXTURES / "poison", repo / "lenient")  # poison's code, its own config
    (repo / "lenient" / "config.toml").write_text(LENIENT_CONFIG)
    (repo / "embedder").mkdir()
    (repo / "embedder" / "config.toml").write_text(EMBEDDER_CONFIG)
    (repo / "embedder" / "model.py").write_text(textwrap.dedent(EMBEDDER_CODE))
    plane.discover()
    await plane.load_all()
    assert plane.ready(), {m.name: m.error for m in plane.models.values()}
    yield plane
    await plane.stop(0)


def app_of(plane: DataPlane) -> DirectRoutes:
    app = FastAPI()
    app.state.dataplane = plane
    app.state.metrics = plane.metrics
    app.state.calls = Calls(plane, plane.metrics, ())
    app.include_router(v2.router)
    app.include_router(openai.router)
    return DirectRoutes(app, app.state.calls)


async def post(plane: DataPlane, path: str, body: bytes, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app_of(plane))
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        return await client.post(path, content=body, headers=headers)


def binary_request(values: np.ndarray, **output: Any) -> tuple[bytes, str]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": list(values.shape),
                    "parameters": {binary.SIZE_PARAMETER: values.nbytes},
                }
            ],
            "outputs": [{"name": "y", **output}],
        }
    )
    return header + values.astype("<f4").tobytes(), str(len(header))


async def test_a_nan_token_in_json_is_a_400_that_says_json_has_none(plane: DataPlane) -> None:
    # Python's json.dumps writes NaN/Infinity tokens; nograd's JSON parser accepts no such token.
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, NaN]}]}'
    answer = await post(plane, "/v2/models/poison/infer", body)
    assert answer.status_code == 400
    assert "JSON has no NaN or Infinity" in answer.json()["error"]


async def test_a_nan_in_a_binary_input_is_a_400_naming_the_input(plane: DataPlane) -> None:
    body, length = binary_request(np.array([[1.0, 2.0], [3.0, np.inf]], dtype=np.float32))
    answer = await post(plane, "/v2/models/poison/infer", body, **{binary.HEADER_LENGTH: length})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "input 'x' holds 1 non-finite value" in error
    assert "at index [1, 1]" in error and "model 'poison'" in error


async def test_a_model_that_allows_them_answers_null_and_marks_the_output(
    plane: DataPlane,
) -> None:
    values = np.array([[np.nan, 1.0]], dtype=np.float32)
    body, length = binary_request(values)
    answer = await post(plane, "/v2/models/lenient/infer", body, **{binary.HEADER_LENGTH: length})
    assert answer.status_code == 200
    output = answer.json()["outputs"][0]
    assert output["data"] == [None, 2.0]
    assert output["parameters"] == {"non_finite": "null"}

    body, length = binary_request(values, parameters={"binary_data": True})
    answer = await post(plane, "/v2/models/lenient/infer", body, **{binary.HEADER_LENGTH: length})
    assert answer.status_code == 200
    header_length = int(answer.headers[binary.HEADER_LENGTH])
    carried = np.frombuffer(answer.content[header_length:], dtype="<f4")
    assert np.isnan(carried[0]) and carried[1] == 2.0


async def test_a_non_finite_embedding_is_a_model_failure_naming_the_model(
    plane: DataPlane,
) -> None:
    good = await post(plane, "/v1/embeddings", orjson.dumps({"model": "embedder", "input": "2"}))
    assert good.status_code == 200
    assert good.json()["data"][0]["embedding"] == [2.0, 2.0, 2.0]
    bad = await post(
        plane,
        "/v1/embeddings",
        orjson.dumps({"model": "embedder", "input": ["1", "nan", "inf"]}),
    )
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["type"] == "server_error"
    assert error["message"] == (
        "model 'embedder' produced a non-finite embedding (NaN or +/-Inf) for input 1 and 1 more"
    )
    assert plane.metrics.inference_errors.labels("embedder")._value.get() == 1
