"""The shipped repository under a budget too small for MiniLM: digits still serves, MiniLM's
requests answer 507, and the start-up log says why."""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from nograd.http import openai, v2
from nograd.http.direct import DirectRoutes
from nograd.observability.metrics import Metrics
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings

SHIPPED = Path(__file__).resolve().parents[3] / "models"
BUDGET = 2 * 1024 * 1024
"""Split between two workers: 1 MiB each, dozens of digits samples (measured as the process's
resident peak) and not one 256-token MiniLM text."""


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[DataPlane]:
    repo = tmp_path / "repo"
    for name in ("digits", "minilm"):
        shutil.copytree(SHIPPED / name, repo / name)
    settings = Settings(model_repository=repo, memory_budget_bytes=BUDGET, workers=2, warmup=False)
    plane = DataPlane(settings, Metrics())
    plane.discover()
    await plane.load_all()
    yield plane
    await plane.stop(0)


async def post(plane: DataPlane, path: str, body: object) -> httpx.Response:
    app = FastAPI()
    app.state.dataplane = plane
    app.state.metrics = plane.metrics
    app.state.calls = Calls(plane, plane.metrics, ())
    app.include_router(v2.router)
    app.include_router(openai.router)
    transport = httpx.ASGITransport(app=DirectRoutes(app, app.state.calls))
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        return await client.post(path, json=body)


async def test_digits_serves_and_minilm_answers_507_under_a_tiny_budget(
    plane: DataPlane, caplog: pytest.LogCaptureFixture
) -> None:
    digits, minilm = plane.models["digits"], plane.models["minilm"]
    assert digits.plan is not None and minilm.plan is not None
    assert digits.plan.limit >= 1
    assert minilm.plan.limit == 0 and minilm.plan.share_bytes == 0
    assert digits.plan.share_bytes + minilm.plan.share_bytes <= BUDGET // 2
    image = {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}
    answer = await post(plane, "/v2/models/digits/infer", {"inputs": [image]})
    assert answer.status_code == 200, answer.text
    text = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}
    answer = await post(plane, "/v2/models/minilm/infer", {"inputs": [text]})
    assert answer.status_code == 507, answer.text
    # Loading (the fixture) warned, naming the model, its minimum and the budget.
    warnings = [r.getMessage() for r in caplog.get_records("setup") if r.levelno == logging.WARNING]
    assert any(w.startswith("model minilm:") and "1.0 MiB" in w for w in warnings), warnings
