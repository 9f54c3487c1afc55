"""A torch model's short CPU batches run on the event loop's thread (``loop_batch_ms``): the
shipped digits model is served so once its batches are measured, at one intra-op thread there; a
model whose own code runs its batches never is, and a bound of 0 turns it off."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.runners import LoopThreadRunner, batch_runner, loop_thread_runner
from nograd.schema.config import ModelConfig
from nograd.schema.tensor_spec import TensorSpec
from nograd.settings import Settings
from tests.unit.serving.test_cpu_batches import started


@pytest.fixture
def own_width() -> Iterator[int]:
    """This thread's torch width, restored after the test."""
    width = torch.get_num_threads()
    yield width
    torch.set_num_threads(width)


def loop_bounds(plane: object) -> dict[str, float | None]:
    return {
        name: None if model.batcher._loop_recovery is None else model.batcher.max_loop_batch_s
        for name, model in plane.models.items()  # type: ignore[attr-defined]
        if model.batcher is not None
    }


async def test_digits_batches_run_on_the_loop_thread_once_measured(
    tmp_path: Path, own_width: int
) -> None:
    plane = await started(tmp_path, cpu_batches=1)
    # After the start, which sets this thread's width to the cores: 2 whatever their count.
    torch.set_num_threads(2)
    try:
        # A torch model (the ONNX one too) has a loop runner; the Python backend's has none.
        assert loop_bounds(plane) == {"digits": 0.001, "accumulator": 0.001, "overlap": None}
        image = np.zeros((1, 1, 8, 8), dtype=np.float32)
        # Unwarmed, its first batches may take longer than the bound; the estimate follows.
        for _ in range(50):
            await plane.infer("digits", None, {"image": image})
            if torch.get_num_threads() == 1:
                break
        assert torch.get_num_threads() == 1  # the loop's thread ran a batch, at one thread
    finally:
        await plane.stop(0)


async def test_a_bound_of_zero_keeps_every_batch_on_the_device_thread(
    tmp_path: Path, own_width: int
) -> None:
    plane = await started(tmp_path, cpu_batches=1, loop_batch_ms=0)
    # After the start, which sets this thread's width to the cores: 2 whatever their count.
    torch.set_num_threads(2)
    try:
        assert set(loop_bounds(plane).values()) == {None}
        image = np.zeros((1, 1, 8, 8), dtype=np.float32)
        for _ in range(50):
            await plane.infer("digits", None, {"image": image})
        assert torch.get_num_threads() == 2
    finally:
        await plane.stop(0)


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def double_handler() -> ModelHandler:
    config = ModelConfig(
        name="double",
        weights=None,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
    )
    return ModelHandler(Double(), config, torch.device("cpu"))


def test_the_loop_runner_runs_at_one_thread_and_leaves_the_device_threads_width(
    own_width: int,
) -> None:
    runner = loop_thread_runner(batch_runner(double_handler()))
    assert isinstance(runner, LoopThreadRunner)
    widths: list[int] = []

    def device_thread() -> None:
        torch.set_num_threads(2)
        torch.ones(256, 256) @ torch.ones(256, 256)  # a parallel region fixes its width
        ready.set()
        ran.wait(5)
        widths.append(torch.get_num_threads())

    ready, ran = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(device_thread)
        assert ready.wait(5)
        part = double_handler().prepare({"x": np.ones((3, 2), dtype=np.float32)})
        try:
            (outputs,) = runner.run_batch([part])
        finally:
            ran.set()
        done.result(5)
    assert outputs["y"].tolist() == [[2.0, 2.0]] * 3
    assert torch.get_num_threads() == 1
    assert widths == [2]


def test_no_loop_runner_for_another_device_or_a_model_running_its_own_batches() -> None:
    elsewhere = TorchRunner(SimpleNamespace(device=torch.device("cuda")))  # type: ignore[arg-type]
    assert loop_thread_runner(elsewhere) is None
    own_code = SimpleNamespace(device=torch.device("cpu"))  # neither a torch runner nor shared
    assert loop_thread_runner(own_code) is None  # type: ignore[arg-type]


def test_on_demand_residency_keeps_every_batch_on_the_device_thread(tmp_path: Path) -> None:
    """Its limit holds what batches allocate on the device thread; the loop's thread would
    allocate from another heap arena (the many-models e2e test's growth bound caught it)."""
    assert Settings(model_repository=tmp_path).max_loop_batch_s == 0.001
    on_demand = Settings(model_repository=tmp_path, model_control="on_demand", loop_batch_ms=5)
    assert on_demand.max_loop_batch_s == 0.0
