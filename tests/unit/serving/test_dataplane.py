"""The data plane in process: loading, readiness that tells the truth, batch loop restarts."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.observability.metrics import Metrics
from nograd.schema.config import ConfigError
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import LimitExceeded, ModelNotFound, ModelNotReady
from nograd.settings import Settings
from tests.unit.conftest import plane_for


def x(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([[v, v] for v in values], dtype=np.float32)}


async def test_a_dead_batch_loop_turns_not_ready_and_is_restarted(tmp_path: Path) -> None:
    plane = plane_for(tmp_path, "poison")
    plane.discover()
    await plane.load_all()
    assert plane.ready()
    assert gc.get_freeze_count() > 0, "the heap left after loading was not frozen"
    batcher = plane.models["poison"].batcher
    assert batcher is not None and batcher._task is not None
    batcher._task.cancel()  # simulate the batch loop dying
    await asyncio.sleep(0.01)
    assert not plane.ready(), "health stayed green with a dead batch loop"
    with pytest.raises(ModelNotReady, match="batch loop is not running"):
        await plane.infer("poison", None, x(1))
    assert await plane.restart_dead_batchers() == 1
    assert plane.ready()
    _, outputs = await plane.infer("poison", None, x(1, 2))
    assert outputs["y"].tolist() == [[2, 2], [4, 4]]
    restarts = plane.metrics.batcher_restarts.labels("poison")._value.get()
    assert restarts == 1
    await plane.stop()


async def test_worker_processes_split_the_explicit_memory_budget(tmp_path: Path) -> None:
    budget = 64 * 2**20
    for workers in (1, 2, 3):
        (tmp_path / str(workers)).mkdir()
        plane = plane_for(
            tmp_path / str(workers), "poison", memory_budget_bytes=budget, workers=workers
        )
        plane.discover()
        await plane.load_all()
        assert plane.metrics.memory_budget.labels("cpu")._value.get() == budget // workers
        await plane.stop()


async def test_loading_and_warm_up_run_on_the_device_thread(tmp_path: Path) -> None:
    plane = plane_for(tmp_path, "poison")
    code = tmp_path / "repo" / "poison" / "model.py"
    code.write_text(
        code.read_text()
        + "\n\nimport threading\n_build = build\n\n\n"
        + "def build(model_dir: Path) -> torch.nn.Module:\n"
        + "    (model_dir / 'built_on.txt').write_text(threading.current_thread().name)\n"
        + "    return _build(model_dir)\n"
    )
    plane.discover()
    await plane.load_all()
    assert plane.ready()

    def serving_thread() -> str:
        return threading.current_thread().name

    executor = plane._loader.threads.executor(torch.device("cpu"))
    serving = await asyncio.get_running_loop().run_in_executor(executor, serving_thread)
    assert (tmp_path / "repo" / "poison" / "built_on.txt").read_text() == serving
    assert serving.startswith("nograd-cpu")
    await plane.stop()


async def test_failed_load_is_not_ready_and_says_why(tmp_path: Path) -> None:
    plane = plane_for(tmp_path, "poison")
    (tmp_path / "repo" / "poison" / "model.py").write_text("raise ImportError('broken on purpose')")
    plane.discover()
    await plane.load_all()
    assert not plane.ready()
    with pytest.raises(ModelNotReady, match="broken on purpose"):
        await plane.infer("poison", None, x(1))
    with pytest.raises(ModelNotFound):
        await plane.infer("nope", None, x(1))
    await plane.stop()


async def test_row_limit_and_draining(tmp_path: Path) -> None:
    plane = plane_for(tmp_path, "poison", max_request_rows=2)
    plane.discover()
    await plane.load_all()
    with pytest.raises(LimitExceeded, match="limit of 2"):
        await plane.infer("poison", None, x(1, 2, 3))
    plane.begin_drain()
    assert not plane.ready()
    with pytest.raises(ModelNotReady, match="draining"):
        await plane.infer("poison", None, x(1))
    assert await plane.wait_idle(0.1)
    await plane.stop()


def test_malformed_config_fails_discovery_naming_file_and_field(tmp_path: Path) -> None:
    plane = plane_for(tmp_path, "poison")
    config = tmp_path / "repo" / "poison" / "config.toml"
    config.write_text(config.read_text().replace('datatype = "FP32"', 'datatype = "FLOAT32"', 1))
    plane.discover()
    assert plane.config_errors
    assert str(config) in plane.config_errors[0]
    assert "field 'inputs.0.datatype'" in plane.config_errors[0]


def test_missing_repository_is_a_config_error(tmp_path: Path) -> None:
    plane = DataPlane(Settings(model_repository=tmp_path / "absent"), Metrics())
    with pytest.raises(ConfigError, match="not a folder"):
        plane.discover()


def test_a_front_s_header_check_refuses_and_counts_as_infer_does(tmp_path: Path) -> None:
    """A request refused from its headers, before decoding, is the same failure as one refused
    after: the same message, a V2 statistics failure and ``rejected{reason="too_large"}``."""
    plane = plane_for(tmp_path, "poison", max_request_rows=2)
    plane.discover()
    check = plane.input_check(plane.get("poison"))
    check({"x": ("FP32", (2, 2))})
    with pytest.raises(LimitExceeded, match=r"input 'x' has 3 rows, more than the limit of 2"):
        check({"x": ("FP32", (3, 2))})
    with pytest.raises(ModelNotFound):
        plane.hold("nope")
    assert plane.metrics.rejected.labels("poison", "too_large")._value.get() == 1
    fails = plane.statistics.of("poison").document("poison", "1")["inference_stats"]["fail"]
    assert fails["count"] == 1
