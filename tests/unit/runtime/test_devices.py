"""torch's threads per worker, and device memory readings for the metrics."""

from __future__ import annotations

from pathlib import Path

import torch

from nograd.host.readings import HostMemory, usable_cores
from nograd.runtime.devices import configure_threads, read_memory
from nograd.runtime.memory import CpuMemoryProbe


def test_default_threads_use_every_usable_core() -> None:
    before = torch.get_num_threads()
    try:
        assert configure_threads(None) == usable_cores()
        assert torch.get_num_threads() == usable_cores()
        assert configure_threads(1) == 1
        # Worker processes split the cores; each keeps at least one thread.
        assert configure_threads(None, workers=2) == max(1, usable_cores() // 2)
        assert configure_threads(None, workers=usable_cores() + 1) == 1
        assert configure_threads(3, workers=2) == 3
    finally:
        torch.set_num_threads(before)


def test_cpu_memory_total_for_metrics_is_the_containers_limit_as_planning_reads_it(
    tmp_path: Path,
) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    for path, text in [
        (proc / "meminfo", "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n"),
        (proc / "self" / "cgroup", "0::/\n"),
        (cgroup / "memory.max", f"{4 * 2**30}\n"),
        (cgroup / "memory.current", f"{2**30}\n"),
    ]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    host = HostMemory(proc_root=proc, cgroup_root=cgroup)
    reading = read_memory(torch.device("cpu"), host)
    assert reading.total == 4 * 2**30, "the metric reported the host's RAM, not the limit"
    assert reading.total == CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup).total_bytes()
    assert reading.peak >= reading.allocated
