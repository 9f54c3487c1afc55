"""The guard inside the data plane: the fallback serves, batches capped at the largest bucket."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nograd.observability.metrics import Metrics
from nograd.runtime.engines.onnx import OnnxPath
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings
from tests.unit.runtime.speed.conftest import (
    BASE,
    REAL_COMPILE,
    gauge,
)

SHIPPED = Path(__file__).resolve().parents[4] / "models"
MODEL_PY = """
import torch

class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)

def build(model_dir):
    torch.manual_seed(0)
    return Scale()
"""


async def loaded_plane(tmp_path: Path, extra: str, metrics: Metrics) -> DataPlane:
    """A data plane serving model ``m`` (MODEL_PY) with ``extra`` config lines."""
    folder = tmp_path / "repo" / "m"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(MODEL_PY)
    (folder / "config.toml").write_text(BASE.format(extra='weights = ""\n' + extra))
    plane = DataPlane(Settings(model_repository=tmp_path / "repo"), metrics)  # type: ignore[call-arg]
    plane.discover()
    await plane.load_all()
    return plane


async def test_data_plane_serves_the_fallback_when_the_guard_refuses(tmp_path: Path) -> None:
    metrics = Metrics()
    plane = await loaded_plane(tmp_path, 'precision = "bf16"\naccuracy_tolerance = 1e-7', metrics)
    try:
        assert plane.ready()
        handler = plane.models["m"].handler
        assert handler is not None and handler.speed_mode == "fp32"
        delta = gauge(metrics, "nograd_model_accuracy_delta", "m", "bf16")
        assert delta is not None and delta > 1e-7
        _, outputs = await plane.infer("m", None, {"x": np.ones((2, 4), dtype=np.float32)})
        assert outputs["y"].dtype == np.float32 and outputs["y"].shape == (2, 2)
    finally:
        await plane.stop()


async def test_data_plane_caps_batches_at_the_largest_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch above the largest bucket would run as several forwards with every caller waiting
    for all of them: the batcher forms batches of at most that bucket instead."""

    def compile_eager(model: torch.nn.Module, **options: Any) -> Any:
        return REAL_COMPILE(model, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", compile_eager)
    metrics = Metrics()
    plane = await loaded_plane(tmp_path, "compile = true\ncompile_buckets = [1, 4]", metrics)
    try:
        model = plane.models["m"]
        assert model.handler is not None and model.handler.speed_mode == "compile"
        assert model.batcher is not None
        assert model.batcher.limit.current == 4 and model.batcher.limit.measured == 16
        x = np.arange(40, dtype=np.float32).reshape(10, 4)
        results = await asyncio.gather(
            *(plane.infer("m", None, {"x": x[i : i + 1]}) for i in range(10)),
            plane.infer("m", None, {"x": x}),
        )
        whole = results[-1][1]["y"]
        assert np.allclose(np.concatenate([r[1]["y"] for r in results[:-1]]), whole, atol=1e-6)
        sizes = metrics.registry.get_sample_value(
            "nograd_batch_size_bucket", {"model": "m", "le": "4.0"}
        )
        count = metrics.registry.get_sample_value("nograd_batch_size_count", {"model": "m"})
        assert sizes is not None and sizes == count, "every batch took at most 4 rows"
    finally:
        await plane.stop()


@pytest.mark.parametrize(
    ("fronts", "control", "allowed"), [(0, "none", "1"), (2, "none", "0"), (0, "on_demand", "0")]
)
async def test_onnx_threads_spin_only_in_a_process_alone_with_its_models(
    tmp_path: Path, fronts: int, control: str, allowed: str
) -> None:
    """ONNX Runtime's threads busy-wait after a run by default: a process alone with the models
    it started with keeps them so; an engine process beside fronts (they decode on the same
    cores) and a server loading models on demand (loads, other models' runs, other replicas on
    the host) let them sleep."""
    shutil.copytree(SHIPPED / "digits", tmp_path / "repo" / "digits")
    settings = Settings(  # type: ignore[call-arg]
        model_repository=tmp_path / "repo",
        fronts=fronts,
        model_control=control,
        engine="onnx",
        warmup=False,
    )
    plane = DataPlane(settings, Metrics())
    plane.discover()
    await plane.load_all()
    try:
        handler = plane.models["digits"].handler
        assert handler is not None
        path = handler.speed_path
        assert isinstance(path, OnnxPath)
        options = path.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == allowed
        image = np.zeros((2, 1, 8, 8), dtype=np.float32)
        _, outputs = await plane.infer("digits", None, {"image": image})
        assert outputs["logits"].shape == (2, 10)
    finally:
        await plane.stop()
