"""Host readings without torch: usable cores under cgroup quotas, GPUs seen from device nodes,
a process's resident memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nograd.host.readings import gpu_visible, process_age_s, resident_bytes, usable_cores


def affinity() -> int:
    return len(os.sched_getaffinity(0))


def cgroup_root(tmp_path: Path, cpu_max: str | None, own_group: str | None = None) -> Path:
    """A cgroup v2 mount with ``cpu.max`` at the root, or in the process's own group."""
    root = tmp_path / "cgroup"
    (tmp_path / "proc" / "self").mkdir(parents=True)
    folder = root if own_group is None else root / own_group
    folder.mkdir(parents=True)
    if own_group is not None:
        (tmp_path / "proc" / "self" / "cgroup").write_text(f"0::/{own_group}\n")
    if cpu_max is not None:
        (folder / "cpu.max").write_text(cpu_max)
    return root


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
    root = cgroup_root(tmp_path, cpu_max)
    assert usable_cores(tmp_path / "proc", root) == (expected or affinity())


def test_the_quota_of_the_process_own_group_counts(tmp_path: Path) -> None:
    root = cgroup_root(tmp_path, "100000 100000\n", own_group="kubepods/pod1/nograd")
    assert usable_cores(tmp_path / "proc", root) == 1


def test_a_quota_above_the_affinity_does_not_add_cores(tmp_path: Path) -> None:
    root = cgroup_root(tmp_path, f"{(affinity() + 8) * 100000} 100000\n")
    assert usable_cores(tmp_path / "proc", root) == affinity()
    assert usable_cores(tmp_path / "proc", tmp_path / "missing") == affinity()


def cgroup_v1_root(tmp_path: Path, quota_us: str, period_us: str = "100000\n") -> Path:
    """A cgroup v1 hierarchy: the process's group under the ``cpu,cpuacct`` controller."""
    root = tmp_path / "cgroup"
    group = root / "cpu" / "docker" / "abc"
    group.mkdir(parents=True)
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    )
    (group / "cpu.cfs_quota_us").write_text(quota_us)
    (group / "cpu.cfs_period_us").write_text(period_us)
    return root


@pytest.mark.parametrize(
    ("quota_us", "period_us", "expected"),
    [
        ("-1\n", "100000\n", None),  # v1's "no quota"
        ("100000\n", "100000\n", 1),
        ("150000\n", "100000\n", 2),  # one and a half cores round up
        ("50000\n", "0\n", None),  # a broken period is ignored, not a crash
    ],
)
def test_a_cgroup_v1_quota_counts_too(
    tmp_path: Path, quota_us: str, period_us: str, expected: int | None
) -> None:
    root = cgroup_v1_root(tmp_path, quota_us, period_us)
    assert usable_cores(tmp_path / "proc", root) == min(expected or affinity(), affinity())


@pytest.mark.parametrize(
    ("nodes", "environ", "expected"),
    [
        ([], {}, False),
        (["nvidia0", "nvidiactl", "nvidia-uvm"], {}, True),
        (["nvidiactl", "nvidia-uvm"], {}, False),  # the driver without a device
        (["kfd", "dri"], {}, True),  # AMD ROCm
        (["nvidia0"], {"CUDA_VISIBLE_DEVICES": ""}, False),
        (["nvidia0"], {"CUDA_VISIBLE_DEVICES": "-1"}, False),
        (["nvidia0"], {"CUDA_VISIBLE_DEVICES": "0"}, True),
        (["kfd"], {"HIP_VISIBLE_DEVICES": ""}, False),
    ],
)
def test_a_gpu_is_seen_from_its_device_nodes_and_visibility_variables(
    tmp_path: Path, nodes: list[str], environ: dict[str, str], expected: bool
) -> None:
    for node in nodes:
        (tmp_path / node).touch()
    assert gpu_visible(tmp_path, environ) is expected
    assert gpu_visible(tmp_path / "missing", {}) is False


def test_resident_memory_of_a_process(tmp_path: Path) -> None:
    ours = resident_bytes(os.getpid())
    assert ours is not None and ours > 10 * 1024 * 1024  # this process has torch loaded
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text("Name:\tpython\nVmRSS:\t  2048 kB\n")
    assert resident_bytes(7, tmp_path) == 2048 * 1024
    assert resident_bytes(8, tmp_path) is None  # gone


def test_process_age_from_its_start_time_and_the_uptime(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    (tmp_path / "self").mkdir()
    # The command name may hold spaces and parentheses; starttime is the 22nd field.
    fields = ["S", *(["0"] * 18), str(100 * ticks), "0"]
    (tmp_path / "self" / "stat").write_text(f"4242 (python -m (x)) {' '.join(fields)}\n")
    (tmp_path / "uptime").write_text("130.50 240.00\n")
    assert process_age_s(tmp_path) == pytest.approx(30.5)
    assert process_age_s(tmp_path / "missing") is None
    age = process_age_s()  # this process, from the real /proc
    assert age is not None and 0 < age < 24 * 3600
