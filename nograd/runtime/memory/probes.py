"""Memory probes per device: what a forward holds at its peak, what the device has free, and
whether an exception means memory ran out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

import torch

from nograd.host.peak import ResidentPeak
from nograd.host.readings import HostMemory
from nograd.runtime.memory.tracker import LiveTensorTracker

_CPU_OOM_MESSAGES: Final = (
    "DefaultCPUAllocator: can't allocate memory",
    "not enough memory",
)


@runtime_checkable
class MemoryProbe(Protocol):
    """What the planner needs to know about one device, whatever its kind."""

    @property
    def device(self) -> str:
        """Device label used in logs and metrics, e.g. ``"cpu"`` or ``"cuda:0"``."""
        ...

    def total_bytes(self) -> int:
        """Capacity of the device as this process may use it."""
        ...

    def available_bytes(self) -> int:
        """Memory this process could still allocate right now."""
        ...

    def allocated_bytes(self) -> int:
        """Memory currently held by this process on the device (for metrics)."""
        ...

    def measure_peak(self, fn: Callable[[], object]) -> int:
        """Peak extra bytes held while ``fn`` runs; its result is freed before returning."""
        ...

    def release_cache(self) -> None:
        """Hands cached-but-unused memory back so availability reads are meaningful."""
        ...


class CpuMemoryProbe(HostMemory):
    """Host memory probe; its peak counts torch's live tensor storages
    (:class:`LiveTensorTracker`): exact, but blind to memory allocated outside torch's Python
    operators, which :class:`ProcessPeakProbe` sees."""

    device = "cpu"

    def measure_peak(self, fn: Callable[[], object]) -> int:
        with LiveTensorTracker("cpu") as tracker:
            result = fn()
        del result
        return tracker.peak_bytes

    def release_cache(self) -> None:
        """Nothing to do: the CPU allocator returns memory to the system itself."""


class CudaMemoryProbe:
    """CUDA probe built on the caching allocator's own counters.

    ``max_memory_allocated`` is exact for everything routed through the caching allocator
    (which is all tensor memory and, in current torch, cuBLAS/cuDNN workspaces), so unlike
    the CPU side no op interception is needed.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaMemoryProbe needs a cuda device, got {device}")
        self.torch_device = device
        self.device = str(device)

    def total_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.torch_device).total_memory)

    def available_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.torch_device)
        # Blocks cached by our allocator look "used" to the driver but are ours to reuse;
        # without adding them back, profiling right before planning shrinks every budget.
        cached = self.reserved_bytes() - self.allocated_bytes()
        return int(free) + max(0, cached)

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.torch_device))

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.torch_device))

    def peak_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def measure_peak(self, fn: Callable[[], object]) -> int:
        # Kernels are asynchronous: synchronise so frees/allocations from earlier work are
        # settled before the baseline and the forward's own work is finished before reading.
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        baseline = self.allocated_bytes()
        result = fn()
        torch.cuda.synchronize(self.torch_device)
        peak = self.peak_allocated_bytes() - baseline
        del result
        return max(0, peak)

    def release_cache(self) -> None:
        torch.cuda.empty_cache()


class ProcessPeakProbe(CpuMemoryProbe):
    """CPU: what a forward really adds to the process, whoever allocates it.

    The live tensor count misses every buffer allocated outside torch's Python operators (oneDNN
    and BLAS scratch, ONNX Runtime's and an AOTInductor library's buffers); the resident peak
    (``nograd.host.peak``) sees them all, and the tensor count stays a floor under it. A measure
    is the largest of ``runs`` runs: the first run at a new shape also builds what later runs
    find cached (oneDNN's kernels and their scratch), as every new batch size does once under
    traffic, and a page the heap happened to keep hides memory from one run, not from all.
    ``fresh``, when given, is entered around each run: an
    engine that keeps memory between runs (an arena, per-thread scratch) hands it back there, so
    the run is measured needing all it uses. ``enough_bytes``: a first reading at least this
    large is taken alone, for an engine whose runs allocate the same each time, where only small
    readings feel the noise (and each run costs a fresh session).
    """

    def __init__(
        self,
        runs: int = 3,
        fresh: Callable[[], AbstractContextManager[object]] | None = None,
        enough_bytes: int | None = None,
        resident: ResidentPeak | None = None,
        proc_root: Path | str = "/proc",
        cgroup_root: Path | str = "/sys/fs/cgroup",
    ) -> None:
        super().__init__(proc_root, cgroup_root)
        if runs < 1:
            raise ValueError(f"runs must be >= 1, got {runs}")
        self._runs = runs
        self._enough = enough_bytes
        self._fresh = fresh or contextlib.nullcontext
        self._resident = resident or ResidentPeak(proc_root)

    def measure_peak(self, fn: Callable[[], object]) -> int:
        peaks = []
        for _ in range(self._runs):
            with self._fresh(), LiveTensorTracker("cpu") as tracker:
                result, peak = self._resident.measure(fn)
                del result
            peaks.append(max(peak.extra_bytes, tracker.peak_bytes))
            if self._enough is not None and peaks[0] >= self._enough:
                break
        return max(peaks)


class DeviceFreeProbe(CudaMemoryProbe):
    """CUDA, for an engine with an allocator of its own (ONNX Runtime's arena), which torch's
    counters cannot see: the device's free memory before and after the forward, inside
    ``fresh``, which empties the engine's allocator before and keeps it from handing memory back
    until the reading is taken. Torch's cached blocks are released first, and torch's own peak
    stays a floor under the reading."""

    def __init__(
        self, device: torch.device, fresh: Callable[[], AbstractContextManager[object]]
    ) -> None:
        super().__init__(device)
        self._fresh = fresh

    def measure_peak(self, fn: Callable[[], object]) -> int:
        with self._fresh():
            torch.cuda.synchronize(self.torch_device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.torch_device)
            baseline = self.allocated_bytes()
            free_before, _ = torch.cuda.mem_get_info(self.torch_device)
            result = fn()
            torch.cuda.synchronize(self.torch_device)
            free_after, _ = torch.cuda.mem_get_info(self.torch_device)
            torch_peak = self.peak_allocated_bytes() - baseline
            del result
        return max(0, int(free_before) - int(free_after), torch_peak)


def probe_for(device: torch.device) -> MemoryProbe:
    """Picks the probe for a device; unsupported kinds fail loudly rather than guess."""
    if device.type == "cpu":
        return CpuMemoryProbe()
    if device.type == "cuda":
        return CudaMemoryProbe(device)
    raise ValueError(f"no memory probe for device type {device.type!r}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether a failure was the device running out of memory.

    OOMs are transient and batch-size dependent (retry smaller, or answer 507), unlike model
    bugs, so they need telling apart.  CPU allocator failures surface as plain RuntimeErrors,
    hence the message match.  Explicit ``raise ... from oom`` chains are followed because
    model wrappers sometimes re-raise with their own exception type.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError):
            message = str(current)
            if any(fragment in message for fragment in _CPU_OOM_MESSAGES):
                return True
        current = current.__cause__
    return False
