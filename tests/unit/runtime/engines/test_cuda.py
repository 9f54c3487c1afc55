"""The engines on a GPU: artifacts exported for CUDA, served there, same answers as eager on the
GPU; ``auto`` choosing among them. Skipped without CUDA (and the onnx case without ONNX Runtime's
CUDA provider, from onnxruntime-gpu)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.runtime.engines.choice import prepare_engine
from nograd.runtime.engines.export import export_model
from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.loader import build_handler
from nograd.schema.config import find_config, load_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[4]
CUDA = torch.device("cuda")


def onnx_cuda() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def load(folder: Path, **override: object) -> ModelHandler:
    path = find_config(folder)
    assert path is not None
    config = load_config(path, override=override or None)
    return build_handler(folder.parent, folder, config, CUDA)


def logits(handler: ModelHandler) -> np.ndarray:
    images = np.arange(9 * 64, dtype=np.float32).reshape(9, 1, 8, 8) % 17
    return TorchRunner(handler).run_batch([handler.prepare({"image": images})])[0]["logits"]


@pytest.fixture
def digits(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "models/digits", tmp_path / "digits")
    return tmp_path / "digits"


@pytest.mark.parametrize("to", ["torch_export", "aoti", "onnx"])
def test_digits_artifacts_serve_on_the_gpu(digits: Path, to: str) -> None:
    if to == "onnx" and not onnx_cuda():
        pytest.skip("ONNX Runtime without its CUDA provider (install onnxruntime-gpu)")
    done = export_model(digits, to, device="cuda")
    served = load(done.folder, device="cuda")
    np.testing.assert_allclose(logits(served), logits(load(digits, device="cuda")), atol=1e-3)


def test_auto_chooses_among_gpu_engines(digits: Path, tmp_path: Path) -> None:
    engines = ["eager", "aoti", "torch_export"] + (["onnx"] if onnx_cuda() else [])
    handler = load(digits, device="cuda", engine="auto", engines=engines)
    expected = logits(load(digits, device="cuda"))
    served = prepare_engine(handler, 64, None, None, [digits / "model.py"], tmp_path / "cache")
    assert served.speed_mode
    np.testing.assert_allclose(logits(served), expected, atol=1e-3)


@pytest.mark.parametrize("engine", ["eager", "torch_export", "aoti", "onnx"])
def test_the_plan_measures_each_engine_on_the_gpu(
    digits: Path, tmp_path: Path, engine: str
) -> None:
    """Each engine's memory measured on the device as it allocates (torch's allocator, or the
    device's free memory for ONNX Runtime's arena); a batch at the limit then fits the budget."""
    from nograd.runtime.engines.paths import serving_ranges
    from nograd.runtime.memory import probe_for
    from nograd.runtime.planner import PlanInput, plan_device, profile_handler

    if engine == "onnx" and not onnx_cuda():
        pytest.skip("ONNX Runtime without its CUDA provider (install onnxruntime-gpu)")
    handler = load(digits, device="cuda", engine=engine, min_speedup=0, max_batch_size=1024)
    served = prepare_engine(handler, 1024, None, None, [digits / "model.py"], tmp_path / "cache")
    probe = probe_for(CUDA)
    cost = profile_handler(served, probe, 1024)
    ((_, path),) = serving_ranges(served)
    assert [item.engine for item in cost.ranges] == [path.name]
    assert not cost.ranges[0].fit.refused
    budget = 8 << 20
    _, (plan,) = plan_device(
        [PlanInput("digits", served, 0, 1024)],
        {"digits": cost},
        probe,
        fraction=0.9,
        explicit_bytes=budget,
    )
    assert 1 <= plan.limit < 1024
    images = np.zeros((plan.limit, 1, 8, 8), dtype=np.float32)
    runner = TorchRunner(served)
    measured = path.memory_probe(probe)
    peak = measured.measure_peak(lambda: runner.run_batch([served.prepare({"image": images})]))
    assert peak <= budget * 1.25
