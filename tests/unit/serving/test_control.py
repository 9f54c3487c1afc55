"""Model control in process: versions and their policy, explicit load/unload, reloads that fail
no request, unload that lets queued requests finish, and the repository poll."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from nograd.formats.triton.api.documents import repository_index
from nograd.observability.metrics import Metrics
from nograd.serving.control.control_calls import load_parameters
from nograd.serving.control.model_control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import ControlRefused, InvalidInput, LoadFailed, ModelNotFound
from nograd.serving.registry import State
from nograd.serving.residency.frozen_heap import settle_heap
from nograd.settings import Settings
from tests.triton_models import FIXTURES as TRITON_FIXTURES
from tests.unit.conftest import FIXTURES

DIGITS = Path(__file__).resolve().parents[3] / "models" / "digits"
SCALER_CONFIG = """
name = "scaler"
weights = ""
max_batch_size = 8
max_queue_delay_ms = 1
device = "cpu"
{policy}

[[inputs]]
name = "x"
datatype = "FP32"
shape = [1]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [1]
"""

SCALER_CODE = """
from pathlib import Path

import torch


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def build(model_dir: Path) -> torch.nn.Module:
    return Scale(float((model_dir / "factor.txt").read_text()))
"""


def add_version(repo: Path, version: int, factor: float) -> Path:
    """A numbered version folder of the scaler: its own factor, the model's shared code."""
    folder = repo / "scaler" / str(version)
    folder.mkdir(parents=True)
    (folder / "factor.txt").write_text(str(factor))
    return folder


def scaler_repo(tmp_path: Path, *versions: int, policy: str = "") -> Path:
    repo = tmp_path / "repo"
    (repo / "scaler").mkdir(parents=True)
    (repo / "scaler" / "config.toml").write_text(SCALER_CONFIG.format(policy=policy))
    (repo / "scaler" / "model.py").write_text(SCALER_CODE)
    for version in versions:
        add_version(repo, version, float(version))
    shutil.copytree(FIXTURES / "slow", repo / "slow")
    return repo


def x(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([[v] for v in values], dtype=np.float32)}


async def started(repo: Path, **settings: object) -> tuple[DataPlane, ModelControl]:
    plane = DataPlane(Settings(model_repository=repo, **settings), Metrics())  # type: ignore[arg-type]
    control = ModelControl(plane)
    control.discover()
    await control.load_startup()
    return plane, control


@pytest.fixture
async def stop() -> AsyncIterator[list[DataPlane]]:
    planes: list[DataPlane] = []
    yield planes
    for plane in planes:
        await plane.stop(0)


async def answer(plane: DataPlane, version: str | None = None, value: float = 1.0) -> float:
    _, outputs = await plane.infer("scaler", version, x(value))
    return float(outputs["y"][0][0])


async def test_the_newest_version_serves_by_default(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, _ = await started(scaler_repo(tmp_path, 1, 2, 3))
    stop.append(plane)
    assert plane.registry.version_names("scaler") == ["3"]
    assert await answer(plane) == 3.0
    with pytest.raises(
        ModelNotFound, match=r"Request for unknown model: 'scaler' version 1 is not found"
    ):
        await answer(plane, "1")


async def test_every_version_serves_with_policy_all(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, _ = await started(scaler_repo(tmp_path, 1, 2, 10, policy='version_policy = "all"'))
    stop.append(plane)
    assert plane.registry.version_names("scaler") == ["1", "2", "10"]
    assert [await answer(plane, v) for v in ("1", "2", "10")] == [1.0, 2.0, 10.0]
    assert await answer(plane) == 10.0, "no version: the newest, numerically"


async def test_specific_versions_serve(tmp_path: Path, stop: list[DataPlane]) -> None:
    repo = scaler_repo(tmp_path, 1, 2, 3, policy="version_policy = { specific = [1, 3] }")
    plane, _ = await started(repo)
    stop.append(plane)
    assert plane.registry.version_names("scaler") == ["1", "3"]


async def test_control_is_refused_when_off(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, control = await started(scaler_repo(tmp_path, 1))
    stop.append(plane)
    with pytest.raises(ControlRefused, match="NOGRAD_MODEL_CONTROL=none"):
        await control.load("scaler")
    with pytest.raises(ModelNotFound):
        await control.unload("absent")


async def test_explicit_loads_only_what_is_asked(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, control = await started(
        scaler_repo(tmp_path, 1), model_control="explicit", load_models="slow"
    )
    stop.append(plane)
    assert plane.ready()
    assert set(plane.models) == {"slow"}
    entries = repository_index(control.index())
    assert {"name": "scaler", "state": "UNAVAILABLE", "reason": "not loaded at start-up"} in entries
    with pytest.raises(ModelNotFound, match="not loaded"):
        await answer(plane)

    await control.load("scaler")
    assert await answer(plane) == 1.0
    await control.unload("scaler")
    with pytest.raises(ModelNotFound, match="unloaded by request"):
        await answer(plane)
    await control.unload("scaler")  # already unloaded: nothing to do
    with pytest.raises(ModelNotFound, match="not in the repository"):
        await control.load("absent")


async def test_a_model_loaded_after_start_up_is_freed_without_unfreezing_the_heap(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    """An unload or eviction used to unfreeze the heap and walk all of it (torch's objects
    too), stopping every model of the process; a model loaded after the start-up freeze is
    freed by collecting the unfrozen heap alone, and freed all the same."""
    plane, control = await started(
        scaler_repo(tmp_path, 1), model_control="explicit", load_models="slow"
    )
    stop.append(plane)
    settle_heap()  # as the server does once the start-up set has loaded
    frozen_at_collections: list[int] = []

    def collecting(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            frozen_at_collections.append(gc.get_freeze_count())

    try:
        await control.load("scaler")
        handler = plane.registry.versions["scaler"]["1"].handler
        assert handler is not None
        module = weakref.ref(handler.module)
        del handler
        gc.callbacks.append(collecting)
        try:
            await control.unload("scaler")
        finally:
            gc.callbacks.remove(collecting)
        assert frozen_at_collections, "nothing was collected when the version was freed"
        assert min(frozen_at_collections) > 0, "the heap was unfrozen to free the version"
        assert module() is None, "the unloaded version was not freed"
    finally:
        gc.unfreeze()


async def test_a_load_over_the_cap_of_loaded_versions_is_refused(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    repo = scaler_repo(tmp_path, 1, 2, policy='version_policy = "all"')
    plane, control = await started(
        repo, model_control="explicit", load_models="slow", max_loaded_models=2
    )
    stop.append(plane)
    # slow and both scaler versions: three, over the cap of two; nothing was loaded.
    with pytest.raises(
        ControlRefused, match=r"3 model versions loaded, over the cap of 2 \(NOGRAD"
    ):
        await control.load("scaler")
    assert set(plane.registry.versions) == {"slow"}
    await control.unload("slow")
    await control.load("scaler")
    assert plane.registry.version_names("scaler") == ["1", "2"]
    # A reload counts the versions it replaces once.
    await control.load("scaler", {"max_batch_size": 4})
    with pytest.raises(ControlRefused, match="over the cap of 2"):
        await control.load("slow")


async def test_a_reload_under_load_fails_no_request(tmp_path: Path, stop: list[DataPlane]) -> None:
    repo = scaler_repo(tmp_path, 1)
    plane, control = await started(repo, model_control="explicit", load_models="*")
    stop.append(plane)
    old = plane.models["scaler"]
    seen: list[float] = []
    running = True

    async def client() -> None:
        while running:
            seen.append(await answer(plane))
            await asyncio.sleep(0)

    clients = [asyncio.create_task(client()) for _ in range(8)]
    await asyncio.sleep(0.1)
    add_version(repo, 2, 2.0)
    await control.load("scaler")
    await asyncio.sleep(0.1)
    running = False
    await asyncio.gather(*clients)  # any failed request raises here
    assert seen[0] == 1.0 and seen[-1] == 2.0
    assert plane.registry.version_names("scaler") == ["2"]
    assert old.state is State.UNLOADED and old.handler is None, "the old version was not freed"


async def test_an_unchanged_version_is_not_reloaded(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, control = await started(
        scaler_repo(tmp_path, 1), model_control="explicit", load_models="*"
    )
    stop.append(plane)
    before = plane.models["scaler"]
    await control.load("scaler")
    assert plane.models["scaler"] is before
    factor = plane.models["scaler"].directory / "factor.txt"
    factor.write_text("5")
    os.utime(factor, ns=(1, 1))  # a new modification time, whatever the clock's resolution
    await control.load("scaler")
    assert plane.models["scaler"] is not before
    assert await answer(plane) == 5.0


async def test_a_failed_load_leaves_the_old_version_serving(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    repo = scaler_repo(tmp_path, 1)
    plane, control = await started(repo, model_control="explicit", load_models="*")
    stop.append(plane)
    add_version(repo, 2, 2.0)
    (repo / "scaler" / "2" / "factor.txt").write_text("not a number")
    with pytest.raises(LoadFailed, match="version 2"):
        await control.load("scaler")
    assert plane.registry.version_names("scaler") == ["1"]
    assert await answer(plane) == 1.0


async def test_a_load_may_override_the_config(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, control = await started(
        scaler_repo(tmp_path, 1), model_control="explicit", load_models="*"
    )
    stop.append(plane)
    await control.load("scaler", load_parameters({"config": '{"max_batch_size": 2}'}).override)
    assert plane.models["scaler"].config.max_batch_size == 2
    with pytest.raises(InvalidInput, match="max_batch_sise"):
        await control.load("scaler", {"max_batch_sise": 2})
    assert plane.models["scaler"].config.max_batch_size == 2


async def test_a_load_overrides_batching_and_queueing_only(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    plane, control = await started(
        scaler_repo(tmp_path, 1), model_control="explicit", load_models="*"
    )
    stop.append(plane)
    before = plane.models["scaler"]
    for override in (
        {"name": "evil1"},
        {"version": "x/../../../pwn"},
        {"module": "factor.txt"},
        {"weights": "factor.txt", "max_batch_size": 2},
    ):
        parameters = load_parameters({"config": json.dumps(override)}).override
        with pytest.raises(InvalidInput, match="cannot be overridden by a load call"):
            await control.load("scaler", parameters)
    assert plane.models["scaler"] is before
    assert sorted(plane.registry.versions) == ["scaler", "slow"]
    for name in ("../scaler", ".scaler", "scaler/1"):
        with pytest.raises(InvalidInput, match="model name"):
            await control.load(name)
    await control.load("scaler", load_parameters({"config": '{"max_queue_size": 3}'}).override)
    assert plane.models["scaler"].config.max_queue_size == 3
    assert await answer(plane) == 1.0


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"config": "{"}, "not JSON"),
        ({"config": "[1]"}, "JSON object"),
        ({"file:1/model.pt": "not base64!"}, "not base64"),
        ({"file:1/model.pt": 5}, "must be base64 text"),
        ({"colour": "red"}, "unknown load parameter 'colour'"),
        ({"config": "[" * 20_000 + "]" * 20_000}, "nested too deeply"),
        ({"config": '{"x": "' + "a" * (1 << 20) + '"}'}, "over the limit of 65536 bytes"),
    ],
)
def test_bad_load_parameters_are_named(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        load_parameters(parameters)


async def test_unload_lets_queued_requests_finish(tmp_path: Path, stop: list[DataPlane]) -> None:
    plane, control = await started(
        scaler_repo(tmp_path, 1), model_control="explicit", load_models="*"
    )
    stop.append(plane)
    body = x(1.0)
    queued = [asyncio.create_task(plane.infer("slow", None, body)) for _ in range(4)]
    await asyncio.sleep(0.02)
    await control.unload("slow")
    results = await asyncio.gather(*queued)
    assert len(results) == 4
    with pytest.raises(ModelNotFound):
        await plane.infer("slow", None, body)


async def test_poll_loads_new_versions_and_unloads_removed_models(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    repo = scaler_repo(tmp_path, 1)
    plane, control = await started(repo, model_control="poll")
    stop.append(plane)
    with pytest.raises(ControlRefused, match="'poll'"):
        await control.load("scaler")
    add_version(repo, 2, 2.0)
    await control.poll_once()
    assert plane.registry.version_names("scaler") == ["2"]
    assert await answer(plane) == 2.0
    (repo / "scaler" / "config.toml").write_text("name = ")  # half written: keeps serving
    await control.poll_once()
    assert await answer(plane) == 2.0
    shutil.rmtree(repo / "slow")
    await control.poll_once()
    assert "slow" not in plane.models
    assert plane.ready()


async def test_a_half_written_triton_config_keeps_its_model_serving(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(TRITON_FIXTURES / "add_sub", repo / "add_sub")
    plane, control = await started(repo, model_control="poll")
    stop.append(plane)
    assert plane.registry.version_names("add_sub") == ["1"]
    (repo / "add_sub" / "config.pbtxt").write_text("name: ")  # half written: keeps serving
    await control.poll_once()
    assert plane.registry.version_names("add_sub") == ["1"]
    shutil.rmtree(repo / "add_sub")
    await control.poll_once()
    assert "add_sub" not in plane.models


async def test_memory_is_planned_again_when_models_load_and_unload(
    tmp_path: Path, stop: list[DataPlane]
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(DIGITS, repo / "digits")
    shutil.copytree(DIGITS, repo / "twin")
    config = repo / "twin" / "config.toml"
    config.write_text(config.read_text().replace('name = "digits"', 'name = "twin"'))
    plane, control = await started(
        repo,
        model_control="explicit",
        load_models="digits",
        memory_budget_bytes=1024 * 1024,
        warmup=False,
    )
    stop.append(plane)

    def limit() -> int:
        batcher = plane.models["digits"].batcher
        assert batcher is not None
        return batcher.limit.current

    alone = limit()
    assert 1 < alone < 64, "the budget, not the cap, sets the limit"
    await control.load("twin")
    shared = limit()
    assert shared < alone, "digits kept its whole budget beside a second model"
    await control.unload("twin")
    assert limit() == alone
