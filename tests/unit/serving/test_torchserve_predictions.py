"""A TorchServe prediction reaches the archive's handler as the front read it: no tensor
validation, batch dimension or ``prepare`` on the way; a V2 call to the same archive still
passes through them."""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from nograd.core.handler_messages import RAW_FIELD, HandlerAnswer
from nograd.formats.torchserve.running.handler import ArchiveHandler
from nograd.observability.metrics import Metrics
from nograd.protocol.torchserve import handler_request
from nograd.serving import dataplane as dataplane_module
from nograd.serving.calls import Call, Calls
from nograd.serving.control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings

HANDLER = """
def handle(data, context):
    if data is None:
        return None
    return [{"twice": 2 * row["body"]["x"]} for row in data]
"""


def _repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    manifest = {"model": {"modelName": "twice", "modelVersion": "1.0", "handler": "twice.py"}}
    with zipfile.ZipFile(repo / "twice.mar", "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        archive.writestr("twice.py", HANDLER)
    return repo


@pytest.fixture
async def calls(tmp_path: Path) -> AsyncIterator[Calls]:
    metrics = Metrics()
    plane = DataPlane(Settings(model_repository=_repository(tmp_path)), metrics)
    control = ModelControl(plane)
    control.discover()
    await control.load_startup()
    try:
        yield Calls(plane, metrics, ())
    finally:
        await plane.stop(0)


async def test_a_prediction_skips_tensor_validation_and_prepare(
    calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = json.dumps({"x": 21}).encode()
    request = handler_request(body, {"content-type": "application/json"})

    # The V2 path validates and prepares: a call over it still answers with the handler's body.
    inputs = np.empty(1, dtype=np.object_)
    inputs[0] = request
    _, outputs = await calls.infer(
        Call("http", "test", time.perf_counter(), None), "twice", None, {RAW_FIELD: inputs}
    )
    assert json.loads(outputs["answer"][0]) == {"twice": 42}

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a TorchServe prediction is not a V2 tensor request")

    monkeypatch.setattr(dataplane_module, "validate", refused)
    monkeypatch.setattr(dataplane_module, "prepared_part", refused)
    monkeypatch.setattr(ArchiveHandler, "prepare", refused)
    answer = await calls.predict(Call("http", "test", time.perf_counter(), None), "twice", request)
    assert isinstance(answer, HandlerAnswer) and answer.status == 200
    assert json.loads(answer.body) == {"twice": 42}
