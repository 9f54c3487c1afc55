"""Tiny models and fakes shared by the speed-mode tests; every mode times as fast as fp32
eager unless a test scripts the timings (autouse)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from nograd.observability.metrics import Metrics
from nograd.runtime.handler import ModelHandler, TensorPart, TorchRunner
from nograd.runtime.speed import guard as speed
from nograd.runtime.speed.guard import (
    CheckBatch,
)
from nograd.schema.config import ModelConfig, TensorSpec

CPU = torch.device("cpu")
REAL_COMPILE = torch.compile


class Tiny(torch.nn.Module):
    """A float output and an integer one, so both comparisons are exercised."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.linear(x) * self.scale
        return {"y": y, "label": torch.argmax(y, dim=1, keepdim=True)}


class RecordingTiny(Tiny):
    """Tiny that records the batch shapes it is called with (eager only)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.shapes.append(tuple(x.shape))
        return super().forward(x)


class TinyText(torch.nn.Module):
    """A token model: embeddings mean-pooled over the mask."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 5)
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(ids.shape))
        weights = mask.unsqueeze(-1).to(torch.float32)
        summed = (self.embed(ids).to(torch.float32) * weights).sum(dim=1)
        return summed / weights.sum(dim=1).clamp(min=1.0)


def tiny_config(**levers: Any) -> ModelConfig:
    return ModelConfig(
        name="tiny",
        weights=None,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(4,)),),
        outputs=(
            TensorSpec(name="y", datatype="FP32", shape=(3,)),
            TensorSpec(name="label", datatype="INT64", shape=(1,)),
        ),
        **levers,
    )


def text_config(**levers: Any) -> ModelConfig:
    return ModelConfig(
        name="text",
        weights=None,
        batch_unit="tokens",
        inputs=(
            TensorSpec(name="ids", datatype="INT64", shape=(-1,)),
            TensorSpec(name="mask", datatype="INT64", shape=(-1,)),
        ),
        outputs=(TensorSpec(name="pooled", datatype="FP32", shape=(5,)),),
        **levers,
    )


class TextHandler(ModelHandler):
    """Masks that are all ones, as a tokenizer would give for unpadded texts."""

    def example(self, rows: int, length: int = 1, seed: int = 0) -> TensorPart:
        ids = np.random.default_rng(seed).integers(1, 16, size=(rows, length))
        mask = np.ones((rows, length), dtype=np.int64)
        return TensorPart({"ids": ids.astype(np.int64), "mask": mask}, rows, length)


def tiny(**levers: Any) -> ModelHandler:
    return ModelHandler(Tiny().eval(), tiny_config(**levers), CPU)


def recording() -> ModelHandler:
    return ModelHandler(RecordingTiny().eval(), tiny_config(), CPU)


def text(**levers: Any) -> TextHandler:
    return TextHandler(TinyText().eval(), text_config(**levers), CPU)


def rows_of(*values: float) -> TensorPart:
    x = np.array([[v, v + 1, v + 2, v + 3] for v in values], dtype=np.float32)
    return TensorPart({"x": x}, len(values))


def gauge(metrics: Metrics, name: str, model: str, mode: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": model, "mode": mode})


def scripted_timings(*totals: float) -> Callable[..., tuple[float, ...]]:
    """A stand-in for ``time_batches``: its n-th call times every batch at ``totals[n]`` / count
    (the first call times fp32 eager, the second the mode); more calls fail the test, through
    ``pytest.fail``, which the guard's fallback (``except Exception``) cannot swallow."""
    calls = iter(totals)

    def fake(
        runner: TorchRunner, batches: list[CheckBatch], passes: int = 3, give_up_above: float = 0.0
    ) -> tuple[float, ...]:
        del runner, passes, give_up_above
        total = next(calls, None)
        if total is None:
            pytest.fail(f"time_batches called more than the {len(totals)} times scripted")
        return tuple(total / len(batches) for _ in batches)

    return fake


@pytest.fixture(autouse=True)
def every_mode_as_fast_as_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed, "time_batches", lambda _runner, batches, **_: (1e-3,) * len(batches))


BASE = """
name = "m"
device = "cpu"
max_batch_size = 16
{extra}
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""
