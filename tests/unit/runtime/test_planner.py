"""The memory plan with a fake device probe: budgets, shares and limits as a GPU would get them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from nograd.runtime.handler import ModelHandler
from nograd.runtime.memory import CostModel
from nograd.runtime.memory.fits import RangedCost, Verdict
from nograd.runtime.planner import PlanInput, plan_device, profile_handler
from tests.unit.runtime.memory.conftest import one_engine


class FakeGpuProbe:
    """What CudaMemoryProbe reports, without a GPU: free memory after the weights are loaded."""

    device = "cuda:0"

    def __init__(self, available: int) -> None:
        self.available = available

    def total_bytes(self) -> int:
        return 16 << 30

    def available_bytes(self) -> int:
        return self.available

    def allocated_bytes(self) -> int:
        return 0

    def measure_peak(self, fn: Any) -> int:
        fn()
        return 0

    def release_cache(self) -> None:
        pass


def profile(cost: CostModel) -> RangedCost:
    return one_engine(cost)


def handler(unit: str = "samples", max_length: int | None = None) -> ModelHandler:
    stub = SimpleNamespace(config=SimpleNamespace(batch_unit=unit), max_length=max_length)
    return cast(ModelHandler, stub)


def test_budget_is_the_fraction_of_free_memory_shared_by_need() -> None:
    probe = FakeGpuProbe(available=10_000_000)
    images = PlanInput("images", handler(), weights_bytes=1000, cap=64)
    text = PlanInput("text", handler("tokens", max_length=128), 5000, cap=4096)
    profiles = {
        "images": profile(CostModel(fixed=1000, per_unit=50_000)),
        "text": profile(CostModel(fixed=0, per_unit=1000, quadratic=10)),
    }
    budget, plans = plan_device([images, text], profiles, probe, fraction=0.5, explicit_bytes=None)
    assert budget == 5_000_000
    by_name = {p.name: p for p in plans}
    assert sum(p.share_bytes for p in plans) == budget
    image_plan, text_plan = by_name["images"], by_name["text"]
    # Each model's limit is the largest batch whose predicted peak fits its share.
    expected_rows = int((image_plan.share_bytes - 1000) // 50_000)
    assert image_plan.limit == min(64, expected_rows) and image_plan.unit == "sample"
    rows = int(text_plan.share_bytes // (1000 * 128 + 10 * 128 * 128))
    assert text_plan.limit == min(4096, rows * 128) and text_plan.unit == "token"
    assert text_plan.predict_bytes(rows=2, cost=2 * 100) == pytest.approx(
        1000 * 200 + 10 * 200 * 100
    )


def test_explicit_budget_wins_and_a_tiny_one_fits_nothing() -> None:
    probe = FakeGpuProbe(available=1 << 40)
    item = PlanInput("big", handler(), 0, cap=32)
    profiles = {"big": profile(CostModel(fixed=0, per_unit=1 << 20))}
    budget, plans = plan_device([item], profiles, probe, fraction=0.9, explicit_bytes=10 << 20)
    assert budget == 10 << 20 and plans[0].limit == 10
    _, plans = plan_device([item], profiles, probe, fraction=0.9, explicit_bytes=1000)
    assert plans[0].limit == 0 and not plans[0].fits_one


def test_the_cap_bounds_the_limit_when_memory_is_plentiful() -> None:
    probe = FakeGpuProbe(available=1 << 40)
    item = PlanInput("small", handler(), 0, cap=16)
    profiles = {"small": profile(CostModel(fixed=0, per_unit=100))}
    _, plans = plan_device([item], profiles, probe, fraction=0.9, explicit_bytes=None)
    assert plans[0].limit == 16


def test_profile_of_a_real_linear_model_is_linear_in_rows() -> None:
    from nograd.runtime.memory import CpuMemoryProbe

    real = _linear_handler(1024, 7168)
    result = profile_handler(real, CpuMemoryProbe(), cap=128)
    (only,) = result.ranges
    assert only.engine == "eager" and only.most_rows is None
    # Input (1024 floats) and output (7168 floats) are alive together, each also in a copy of its
    # own for part of the batch (the request's rows and the collated batch; the output tensor and
    # the answer's array): between 32 and 80 KiB a row, measured as the process's resident
    # peak, in whole pages (a batch of 128 rows is megabytes, far above the heap's own noise), so
    # the plan never promises less than the tensors themselves, and each row costs no more than
    # both copies (the forward's own scratch is the fixed part).
    tensors = (1024 + 7168) * 4
    planned = only.fit.model
    assert planned.per_unit > 0
    for rows in (1, 8, 32, 128):
        assert planned.predict(rows) >= rows * tensors
    assert planned.per_unit <= 2.5 * tensors
    # The first profile of a process may carry first-use costs (the forward's own scratch, the
    # heap's growth): it is then measured again, and the second holds.
    assert only.fit.verdict in (Verdict.FITS, Verdict.REMEASURED)
    assert abs(only.fit.errors[-1]) <= 0.25


def _linear_handler(inputs: int = 256, outputs: int = 512) -> ModelHandler:
    """A real ``torch.nn.Linear`` served as a model of ``inputs`` floats to ``outputs``."""
    from nograd.schema.config import ModelConfig

    config = ModelConfig.model_validate(
        {
            "name": "lin",
            "weights": "",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [inputs]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [outputs]}],
        }
    )

    class Lin(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(inputs, outputs)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    return ModelHandler(Lin().eval(), config, torch.device("cpu"))


def test_an_estimate_bounds_the_warm_ups_batches_with_twice_their_bytes_per_row() -> None:
    from nograd.runtime.memory.fits import covering
    from nograd.runtime.planner import ESTIMATE_MARGIN, estimated_cost

    points = [(1, 1, 40_000), (4, 1, 100_000), (8, 1, 150_000)]
    cost = estimated_cost(_linear_handler(), points)
    assert cost is not None
    (only,) = cost.ranges
    assert only.fit.verdict is Verdict.ESTIMATED and not only.fit.refused
    for rows, _, measured in points:
        assert cost.predict(rows) >= measured
    bound = covering(points, quadratic=False)
    assert only.fit.model.per_unit == ESTIMATE_MARGIN * bound.per_unit > 0
    assert estimated_cost(_linear_handler(), []) is None


def test_a_profile_gives_up_between_measurements_when_told_and_hands_memory_back() -> None:
    from nograd.runtime.memory import CpuMemoryProbe
    from nograd.runtime.planner import ProfileStopped

    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(ProfileStopped):
        profile_handler(_linear_handler(), CpuMemoryProbe(), cap=8, stop=stop)
    assert len(asked) == 3
