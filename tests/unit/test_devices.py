"""Core counts under CPU quotas, and the heap settled after loading."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from app.dataplane import settle_heap
from app.runtime.devices import configure_threads, usable_cores


def affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", None),  # no quota: the affinity decides
        ("50000 100000\n", 1),  # half a core still gets one thread
        ("100000 100000\n", 1),
        ("not a quota\n", None),
    ],
)
def test_usable_cores_respects_a_cgroup_quota(
    tmp_path: Path, cpu_max: str, expected: int | None
) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    assert usable_cores(path) == (expected or affinity())


def test_a_quota_above_the_affinity_does_not_add_cores(tmp_path: Path) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(f"{(affinity() + 8) * 100000} 100000\n")
    assert usable_cores(path) == affinity()
    assert usable_cores(tmp_path / "missing") == affinity()


def test_default_threads_use_every_usable_core() -> None:
    before = torch.get_num_threads()
    try:
        assert configure_threads(None) == usable_cores()
        assert torch.get_num_threads() == usable_cores()
        assert configure_threads(1) == 1
    finally:
        torch.set_num_threads(before)


def test_settled_heap_is_frozen_and_new_garbage_still_collected() -> None:
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0

        class Cycle:
            other: object = None

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2, "a cycle created after the freeze was not collected"
    finally:
        gc.unfreeze()
