"""Budgets: the device budget, per-model shares, sizes as the log shows them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nograd.core.units import format_bytes
from nograd.runtime.memory import device_budget

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


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"
