"""Memory probes: CUDA through a fake of torch.cuda, CPU through faked /proc and cgroups;
out-of-memory detection."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nograd.runtime.memory import (
    CpuMemoryProbe,
    CudaMemoryProbe,
    MemoryProbe,
    is_out_of_memory,
    probe_for,
)

FLOAT32 = 4


class FakeCuda:
    """Caching-allocator counters standing in for torch.cuda."""

    def __init__(self) -> None:
        self.allocated = 1000
        self.peak = 1000
        self.reserved = 4000
        self.calls: list[str] = []

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def record(name: str, result: Callable[[], object]) -> Callable[..., object]:
            def fake(*args: object, **kwargs: object) -> object:
                self.calls.append(name)
                return result()

            return fake

        def reset() -> None:
            self.peak = self.allocated

        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", record("synchronize", lambda: None))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", record("reset", reset))
        monkeypatch.setattr(cuda, "memory_allocated", record("allocated", lambda: self.allocated))
        monkeypatch.setattr(cuda, "max_memory_allocated", record("peak", lambda: self.peak))
        monkeypatch.setattr(cuda, "memory_reserved", record("reserved", lambda: self.reserved))
        monkeypatch.setattr(cuda, "mem_get_info", record("info", lambda: (10_000, 80_000)))
        monkeypatch.setattr(cuda, "empty_cache", record("empty_cache", lambda: None))
        monkeypatch.setattr(
            cuda,
            "get_device_properties",
            record("props", lambda: SimpleNamespace(total_memory=80_000)),
        )


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    fake = FakeCuda()
    fake.install(monkeypatch)
    yield fake


def test_cuda_probe_measures_peak_delta(fake_cuda: FakeCuda) -> None:
    probe = CudaMemoryProbe(torch.device("cuda", 0))
    fake_cuda.alloc(5000)  # an earlier peak that must not leak into the measurement

    def forward() -> str:
        fake_cuda.alloc(300)  # batch
        fake_cuda.alloc(700)  # activation
        fake_cuda.alloc(-700)
        return "output"

    assert probe.measure_peak(forward) == 1000
    calls = fake_cuda.calls
    assert calls.index("synchronize") < calls.index("reset") < calls.index("allocated")
    assert calls.count("synchronize") == 2
    assert calls[-1] == "peak"

    probe.release_cache()
    assert fake_cuda.calls[-1] == "empty_cache"


def test_cuda_probe_readings(fake_cuda: FakeCuda) -> None:
    probe = probe_for(torch.device("cuda", 0))
    assert isinstance(probe, CudaMemoryProbe)
    assert isinstance(probe, MemoryProbe)
    assert probe.device == "cuda:0"
    assert probe.total_bytes() == 80_000
    assert probe.allocated_bytes() == 1000
    assert probe.reserved_bytes() == 4000
    # Driver-free memory plus what our caching allocator holds but is not using.
    assert probe.available_bytes() == 10_000 + (4000 - 1000)


def test_probe_for_rejects_unknown_devices() -> None:
    assert isinstance(probe_for(torch.device("cpu")), CpuMemoryProbe)
    with pytest.raises(ValueError):
        probe_for(torch.device("meta"))
    with pytest.raises(ValueError):
        CudaMemoryProbe(torch.device("cpu"))


def test_cpu_probe_reads_this_machine() -> None:
    probe = CpuMemoryProbe()
    assert isinstance(probe, MemoryProbe)
    assert probe.device == "cpu"
    assert 0 < probe.available_bytes() <= probe.total_bytes()
    assert probe.allocated_bytes() > 10 * 2**20  # torch alone is tens of MB resident
    assert probe.measure_peak(lambda: torch.empty(1024, dtype=torch.uint8)) == 1024


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cpu_probe_meminfo_without_cgroup_limit(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal:  1000 kB\nMemFree: 10 kB\nMemAvailable:  600 kB\n")
    _write(proc / "self" / "cgroup", "0::/\n")
    _write(cgroup / "memory.max", "max\n")
    probe = CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup)
    assert probe.total_bytes() == 1000 * 1024
    assert probe.available_bytes() == 600 * 1024


def test_cpu_probe_honours_cgroup_v2_limit(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n")
    _write(proc / "self" / "cgroup", "0::/\n")
    _write(cgroup / "memory.max", f"{4 * 2**30}\n")
    _write(cgroup / "memory.current", f"{3 * 2**30}\n")
    _write(cgroup / "memory.stat", f"anon 123\ninactive_file {2**29}\n")
    probe = CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup)
    assert probe.total_bytes() == 4 * 2**30
    # Inactive page cache is reclaimable, so it counts as available.
    assert probe.available_bytes() == 4 * 2**30 - (3 * 2**30 - 2**29)


def test_cpu_probe_honours_nested_cgroup_v1_limit(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal: 64000000 kB\nMemAvailable: 60000000 kB\n")
    _write(proc / "self" / "cgroup", "5:memory:/pod/abc\n0::/\n")
    _write(cgroup / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    own = cgroup / "memory" / "pod" / "abc"
    _write(own / "memory.limit_in_bytes", f"{2**30}\n")
    _write(own / "memory.usage_in_bytes", f"{2**28}\n")
    _write(own / "memory.stat", "cache 1\ntotal_inactive_file 0\n")
    probe = CpuMemoryProbe(proc_root=proc, cgroup_root=cgroup)
    assert probe.total_bytes() == 2**30
    assert probe.available_bytes() == 2**30 - 2**28


def test_is_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1099511627776 bytes. Error code 12"
        )
    )
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried"))
    assert not is_out_of_memory(ValueError("not enough memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_is_out_of_memory_real_cpu_allocation_failure() -> None:
    # 32 PiB exceeds any x86-64/arm64 address space, so this fails even with overcommit.
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 55, dtype=torch.uint8)
    assert is_out_of_memory(info.value)


def test_is_out_of_memory_follows_explicit_cause() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as exc:
            raise ValueError("model failed") from exc
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)


def test_the_process_peak_sees_memory_torch_does_not_allocate() -> None:
    import mmap

    from nograd.runtime.memory import ProcessPeakProbe

    def forward() -> int:
        # 16 MiB mapped outside torch, as an engine's own allocator maps it, every page written,
        # and unmapped before the probe reads its peak.
        with mmap.mmap(-1, 16 << 20) as block:
            for offset in range(0, 16 << 20, 4096):
                block[offset] = 1
            return block[0]

    assert CpuMemoryProbe().measure_peak(forward) == 0
    assert 15 << 20 <= ProcessPeakProbe().measure_peak(forward) <= 20 << 20
    # And torch's own storages stay a floor under it.
    assert ProcessPeakProbe().measure_peak(lambda: torch.ones(1 << 20)) >= 4 << 20


def test_the_device_free_probe_reads_an_arena_torch_cannot_see(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import contextmanager

    from nograd.runtime.memory import DeviceFreeProbe

    free = [10_000]
    fresh: list[str] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80_000))

    @contextmanager
    def fresh_arena() -> Iterator[None]:
        fresh.append("in")
        yield
        fresh.append("out")

    def forward() -> str:
        free[0] -= 6000  # the engine's arena grows; torch allocates nothing
        return "output"

    probe = DeviceFreeProbe(torch.device("cuda", 0), fresh_arena)
    assert probe.measure_peak(forward) == 6000
    assert fresh == ["in", "out"]
    # Torch's own peak still counts when it is the larger.
    assert probe.measure_peak(lambda: fake_cuda.alloc(9000)) == 9000
