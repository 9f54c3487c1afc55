"""A process that runs two CPU batches at once (``cpu_batches``, an engine beside fronts by
default): each batch is planned on half the activation budget, a torch model's batches run side
by side, and a model whose own code runs its batches, or a sequence model, runs one at a time."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from nograd.http import v2
from nograd.http.direct import DirectRoutes
from nograd.observability.metrics import Metrics
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings
from tests.e2e.test_triton_sequences import CONFIG, accumulator

SHIPPED = Path(__file__).resolve().parents[3] / "models"
BUDGET = 64 * 1024 * 1024

OVERLAP_CONFIG = """
name: "overlap"
backend: "python"
max_batch_size: 4
dynamic_batching { max_queue_delay_microseconds: 1000 }
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""
OVERLAP_MODEL = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

_lock = threading.Lock()
_running = 0
_most = 0


class TritonPythonModel:
    def execute(self, requests):
        global _running, _most
        with _lock:
            _running += 1
            _most = max(_most, _running)
        time.sleep(0.01)
        with _lock:
            _running -= 1
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = np.full_like(x, _most)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
"""A Python-backend model that answers the most ``execute`` calls it has seen at once."""


async def started(tmp_path: Path, **settings: object) -> DataPlane:
    repo = tmp_path / "repo"
    shutil.copytree(SHIPPED / "digits", repo / "digits")
    (repo / "overlap" / "1").mkdir(parents=True)
    (repo / "overlap" / "config.pbtxt").write_text(OVERLAP_CONFIG)
    (repo / "overlap" / "1" / "model.py").write_text(OVERLAP_MODEL)
    accumulator(repo / "accumulator" / "1" / "model.onnx")
    config = CONFIG.format(name="accumulator", idle_us=30_000_000, delay_us=0)
    (repo / "accumulator" / "config.pbtxt").write_text(config)
    plane = DataPlane(
        Settings(model_repository=repo, memory_budget_bytes=BUDGET, warmup=False, **settings),
        Metrics(),
    )
    plane.discover()
    await plane.load_all()
    return plane


@pytest.fixture
async def two_at_once(tmp_path: Path) -> AsyncIterator[DataPlane]:
    plane = await started(tmp_path, cpu_batches=2)
    yield plane
    await plane.stop(0)


def budget_of(plane: DataPlane) -> float | None:
    return plane.metrics.registry.get_sample_value(
        "nograd_device_memory_budget_bytes", {"device": "cpu"}
    )


async def test_each_of_two_batches_is_planned_on_half_the_budget(
    two_at_once: DataPlane, tmp_path: Path
) -> None:
    # The gauge shows the device's whole budget; the models share each batch's half of it.
    assert budget_of(two_at_once) == BUDGET
    plans = [m.plan for m in two_at_once.models.values() if m.plan is not None]
    assert plans and sum(plan.share_bytes for plan in plans) <= BUDGET // 2
    one = await started(tmp_path / "one", cpu_batches=1)
    try:
        assert budget_of(one) == BUDGET
        assert one.models["digits"].batcher is not None
        assert one.models["digits"].batcher.max_running_batches == 1
    finally:
        await one.stop(0)


async def test_a_torch_model_runs_side_by_side_and_the_others_one_at_a_time(
    two_at_once: DataPlane,
) -> None:
    running = {
        name: (model.batcher.max_running_batches, model.batcher.max_staged_batches)
        for name, model in two_at_once.models.items()
        if model.batcher is not None
    }
    assert running == {"digits": (2, 1), "overlap": (1, 0), "accumulator": (1, 0)}


async def test_a_model_whose_code_runs_its_batches_never_runs_two_at_once(
    two_at_once: DataPlane,
) -> None:
    app = FastAPI()
    app.state.dataplane = two_at_once
    app.state.metrics = two_at_once.metrics
    app.state.calls = Calls(two_at_once, two_at_once.metrics, ())
    app.include_router(v2.router)
    transport = httpx.ASGITransport(app=DirectRoutes(app, app.state.calls))
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        answers = await asyncio.gather(
            *(client.post("/v2/models/overlap/infer", json=body) for _ in range(24))
        )
    assert [a.status_code for a in answers] == [200] * 24
    assert {a.json()["outputs"][0]["data"][0] for a in answers} == {1.0}
