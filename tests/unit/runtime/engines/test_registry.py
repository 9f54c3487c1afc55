"""The engine table and its registry: every list of engines derives from the table, and a new
engine is one module and one row."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from nograd.cli import export_command
from nograd.core import engines as table
from nograd.core.engines import artifact_engines, engine_choices, engine_row, signature_formats
from nograd.runtime.engines import choice, registry
from nograd.runtime.engines.paths import EnginePath
from nograd.runtime.engines.registry import Engine, UnknownEngine, engine, every_engine
from nograd.runtime.handler import TorchRunner
from nograd.runtime.memory import CudaMemoryProbe, ProcessPeakProbe, probe_for
from nograd.runtime.planner import profile_handler
from nograd.schema.config import ConfigError, load_config
from nograd.settings import Settings
from tests.unit.runtime.engines import copied_program
from tests.unit.runtime.engines.tiny import tiny_folder, tiny_handler


def test_every_row_is_implemented_by_the_object_it_names() -> None:
    for row, implementation in zip(table.ENGINES, every_engine(), strict=True):
        assert isinstance(implementation, Engine)
        assert implementation.row == row
    assert {row.name for row in table.ENGINES} == {
        "torch_export",
        "aoti",
        "onnx",
        "onnx-int8",
        "torchscript",
    }
    assert engine_row("onnx-int8").int8_of == "onnx"
    # TorchScript is served as brought (Triton repositories) and built (nograd export).
    assert engine_row("torchscript").buildable and "torchscript" in artifact_engines()
    assert engine("onnx-int8").unsupported(torch.device("cuda")) is not None
    assert engine("onnx").unsupported(torch.device("cpu")) is None
    with pytest.raises(UnknownEngine, match="known: torch_export"):
        engine("tensorrt")


def test_settings_configs_and_the_command_line_take_their_names_from_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert engine_choices() == ("eager", "auto", "torch_export", "aoti", "onnx", "torchscript")
    assert signature_formats() == ("torch_export", "onnx")
    assert Settings(engine="aoti").engine == "aoti"
    with pytest.raises(
        ValidationError, match="one of eager, auto, torch_export, aoti, onnx, torchscript"
    ):
        Settings(engine="onnx-int8")
    folder = tiny_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"field 'engine'.*is not one of"):
        load_config(folder / "config.toml", override={"engine": "tensorrt"})
    with pytest.raises(ConfigError, match="field 'format'"):
        load_config(folder / "config.toml", override={"format": "onnx-int8", "artifact": "m"})
    with pytest.raises(SystemExit):
        export_command([str(folder), "--to", "tensorrt"])
    assert "--to {torch_export,aoti,onnx,torchscript}" in capsys.readouterr().err


@pytest.fixture
def one_more_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The table with ``copied_program``'s row added, as a new engine adds its own."""
    monkeypatch.setattr(table, "ENGINES", (*table.ENGINES, copied_program.ROW))
    registry.engine.cache_clear()
    yield copied_program.ROW.name
    registry.engine.cache_clear()


def test_a_new_engine_is_one_module_and_one_row(
    one_more_engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert one_more_engine in artifact_engines() and one_more_engine in engine_choices()
    assert Settings(engine=one_more_engine).engine == one_more_engine
    handler = tiny_handler(tmp_path, f'engine = "{one_more_engine}"\nmin_speedup = 0')
    x = np.random.default_rng(1).random((3, 16), dtype=np.float32)
    eager = TorchRunner(handler).run_batch([handler.prepare({"x": x})])[0]["scores"]
    served = choice.prepare_engine(handler, 32, None, None, [], tmp_path / "cache")
    assert served.speed_mode == one_more_engine
    assert isinstance(served.speed_path, EnginePath)
    got = TorchRunner(served).run_batch([served.prepare({"x": x})])[0]["scores"]
    np.testing.assert_allclose(got, eager, atol=1e-5)
    assert list((tmp_path / "cache").glob(f"tiny-v1-{one_more_engine}-*.copied.pt2"))
    # Its memory is measured the default way: the process's peak on CPU.
    cost = profile_handler(served, probe_for(torch.device("cpu")), 32)
    assert [item.engine for item in cost.ranges] == [one_more_engine]
    assert isinstance(
        served.speed_path.memory_probe(probe_for(torch.device("cpu"))), ProcessPeakProbe
    )


def test_each_engine_says_how_its_memory_is_measured(tmp_path: Path) -> None:
    handler = tiny_handler(tmp_path, 'engine = "onnx"\nmin_speedup = 0')
    served = choice.prepare_engine(handler, 32, None, None, [], tmp_path / "cache")
    path = served.speed_path
    assert isinstance(path, EnginePath) and path.name == "onnx"
    cpu = path.memory_probe(probe_for(torch.device("cpu")))
    assert isinstance(cpu, ProcessPeakProbe)
    gpu_probe = CudaMemoryProbe.__new__(CudaMemoryProbe)
    gpu_probe.device = "cuda:0"
    # A torch engine on a GPU is measured by torch's allocator: the device's own probe.
    assert EnginePath((), ()).memory_probe(gpu_probe) is gpu_probe


def test_the_plan_logs_the_engine_of_each_range(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from nograd.runtime.planner import PlanInput, log_plan, plan_device

    handler = tiny_handler(tmp_path, 'engine = "onnx"\nmin_speedup = 0')
    served = choice.prepare_engine(handler, 32, None, None, [], tmp_path / "cache")
    probe = probe_for(torch.device("cpu"))
    cost = profile_handler(served, probe, 32)
    budget, plans = plan_device(
        [PlanInput("tiny", served, 0, 32)],
        {"tiny": cost},
        probe,
        fraction=0.9,
        explicit_bytes=1 << 20,
    )
    with caplog.at_level(logging.DEBUG, logger="nograd.runtime.planner"):
        log_plan("cpu", budget, plans)
    plan = next(r for r in caplog.records if r.getMessage() == "memory plan for cpu")
    assert plan.levelno == logging.INFO and plan.budget_bytes == 1 << 20
    (row,) = plan.table
    assert (row["model"], row["device"], row["engine"]) == ("tiny", "cpu", "onnx")
    assert row["limit"] == plans[0].limit and row["share_bytes"] == plans[0].share_bytes
    # Each fit's numbers: at debug level, under the table.
    fit = next(r for r in caplog.records if "model tiny on onnx: cost model" in r.getMessage())
    assert fit.levelno == logging.DEBUG
    assert plans[0].fit_rows()[0][0] == "onnx"


def test_onnx_without_its_cuda_provider_is_refused_for_a_gpu_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU with ONNX Runtime's CPU build, auto used to export the model (seconds, every
    start) and only then find no CUDA provider to open it with."""
    import onnxruntime

    onnx = engine("onnx")
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert onnx.unsupported(torch.device("cpu")) is None
    assert "no CUDA provider" in (onnx.unsupported(torch.device("cuda", 0)) or "")
    monkeypatch.setattr(
        onnxruntime,
        "get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    assert onnx.unsupported(torch.device("cuda", 0)) is None
