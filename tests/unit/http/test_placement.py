"""``GET /nograd/placement`` on a loaded data plane: the served model resident with its bytes
and queue, the repository's other models not; guarded as the repository index is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from nograd.http import placement
from nograd.http.paths import operator_group
from nograd.serving.calls.access import MODEL_REPOSITORY
from nograd.serving.control.model_control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.serving.residency.placement import Placement
from tests.unit.conftest import plane_for


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[DataPlane]:
    plane = plane_for(tmp_path, "poison", "slow")
    plane.discover(lambda name: name == "poison")
    await plane.load_all()
    yield plane
    await plane.stop(0)


async def test_the_served_model_is_resident_with_its_bytes(plane: DataPlane) -> None:
    app = FastAPI()
    control = ModelControl(plane)
    app.state.placement = Placement(control, plane.registry, None, workers=1)
    app.include_router(placement.router)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
        answer = await client.get("/nograd/placement")
    assert answer.status_code == 200, answer.text
    document = answer.json()
    assert (document["model_control"], document["workers"], document["workers_answered"]) == (
        control.mode,
        1,
        1,
    )
    models = {row["name"]: row for row in document["models"]}
    poison = plane.registry.models["poison"]
    assert models["poison"] == {
        "name": "poison",
        "state": "resident",
        "bytes": poison.weights_bytes,
        "queue_depth": 0,
        "in_flight": 0,
        "pinned": False,
        "resident_workers": 1,
    }
    assert (models["slow"]["state"], models["slow"]["bytes"]) == ("not_resident", 0)
    assert document["memory"] == {
        "limit_bytes": None,
        "used_bytes": poison.weights_bytes,
        "free_bytes": None,
    }


def test_the_placement_route_is_guarded_like_the_repository_index() -> None:
    assert operator_group("/nograd/placement") == MODEL_REPOSITORY
    assert operator_group("/v2/repository/index") == MODEL_REPOSITORY
