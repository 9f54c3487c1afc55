"""Budgets: the device budget, per-model shares, the logged plan table."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nograd.runtime.memory import (
    PlanRow,
    device_budget,
    format_bytes,
    format_plan,
)

FLOAT32 = 4


class FixedProbe:
    device = "cpu"

    def __init__(self, available: int) -> None:
        self.available = available

    def total_bytes(self) -> int:
        return self.available * 2

    def available_bytes(self) -> int:
        return self.available

    def allocated_bytes(self) -> int:
        return 0

    def measure_peak(self, fn: Callable[[], object]) -> int:
        fn()
        return 0

    def release_cache(self) -> None:
        pass


def test_device_budget() -> None:
    probe = FixedProbe(available=1000)
    assert device_budget(probe, fraction=0.9, explicit_bytes=None) == 900
    assert device_budget(probe, fraction=0.9, explicit_bytes=12345) == 12345
    with pytest.raises(ValueError):
        device_budget(probe, fraction=0.0, explicit_bytes=None)
    with pytest.raises(ValueError):
        device_budget(probe, fraction=1.5, explicit_bytes=None)


def test_format_plan() -> None:
    table = format_plan(
        [
            PlanRow("resnet", "cuda:0", 97_800_000, 10240.0, 64, 2 * 2**30, fit="fits +1.0%"),
            PlanRow(
                "minilm",
                "cpu",
                90_000_000,
                1536.0,
                4096,
                512 * 2**20,
                unit="token",
                engine="onnx<=1",
                fit="bounded +30.2%",
            ),
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[0].split() == [
        "model",
        "device",
        "weights",
        "engine",
        "per",
        "unit",
        "fit",
        "limit",
        "budget",
    ]
    assert set(lines[1]) <= {"-", " "}
    assert "resnet" in lines[2] and "10.0 KiB/sample" in lines[2] and "2.0 GiB" in lines[2]
    assert "eager" in lines[2] and "fits +1.0%" in lines[2]
    assert "1.5 KiB/token" in lines[3] and "4096" in lines[3]
    assert "onnx<=1" in lines[3] and "bounded +30.2%" in lines[3]
    # Right-aligned numeric columns end at the same offset.
    assert lines[2].index("64") + 2 == lines[3].index("4096") + 4


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"
