"""Devices: resolving ``auto``, one inference thread per device, and memory readings for metrics."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nograd.host.readings import HostMemory, usable_cores
from nograd.runtime.executor import LastIdleExecutor


def resolve_device(spec: str) -> torch.device:
    """``auto`` means the first GPU when there is one; an unavailable GPU is a load error."""
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
        return torch.device("cuda", index)
    return device


def configure_threads(count: int | None, workers: int = 1, *, shared: bool = False) -> int:
    """Intra-op threads for CPU forwards; by default the cores the process may use, divided
    among the server's worker processes (at least one each). ``shared``: workers take cores
    batch by batch (nograd/host/ledger.py), so a worker starts with all of them.

    A compute-bound model is limited by its forward, so it gets every core it may use; torch's
    own default ignores a container's CPU quota.
    """
    if count is not None:
        threads = count
    else:
        threads = usable_cores() if shared else max(1, usable_cores() // workers)
    torch.set_num_threads(threads)
    return threads


def device_label(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


class DeviceThreads:
    """One executor per device: one thread per GPU, ``cpu_batches`` threads for the CPU.

    Forwards of every model on a GPU run on that device's thread, one after another: this keeps
    torch off the event loop, keeps one device's kernels from fighting over it, and makes the CUDA
    current-stream state belong to one thread. On the CPU several batches may run at once, each
    at the width ``nograd.host.cpu_batches`` grants it, the thread idle most recently taking the
    next (``LastIdleExecutor``).
    """

    def __init__(self, cpu_batches: int = 1) -> None:
        self._lock = threading.Lock()
        self._executors: dict[str, Executor] = {}
        self.cpu_batches = max(1, cpu_batches)

    def executor(self, device: torch.device) -> Executor:
        label = device_label(device)
        with self._lock:
            if label not in self._executors:
                name = f"nograd-{label.replace(':', '')}"
                if device.type == "cpu" and self.cpu_batches > 1:
                    self._executors[label] = LastIdleExecutor(self.cpu_batches, name)
                else:
                    self._executors[label] = ThreadPoolExecutor(1, thread_name_prefix=name)
            return self._executors[label]

    async def run_load(
        self, device: torch.device, load: Callable[[], None], beside_batches: bool
    ) -> None:
        """Run a model's ``load`` on the device's thread, or, on CPU once models serve, on a
        thread of its own that ends with the load, so the batches of the models serving run
        meanwhile.

        A thread that ends takes its OpenMP team with it: a second team kept alive beside the
        device thread's would make every later forward's threads sleep sooner. On a GPU the
        load stays on the device's thread, which owns the current stream and the graphs warm-up
        captures.
        """
        loop = asyncio.get_running_loop()
        if not beside_batches or device.type != "cpu":
            await loop.run_in_executor(self.executor(device), load)
            return
        own = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nograd-load")
        try:
            await loop.run_in_executor(own, load)
        finally:
            own.shutdown(wait=False)

    def shutdown(self) -> None:
        with self._lock:
            for executor in self._executors.values():
                executor.shutdown(wait=False, cancel_futures=True)
            self._executors.clear()


@dataclass(frozen=True)
class MemoryReading:
    """One device's memory, in bytes, as the metrics export it."""

    allocated: int
    reserved: int
    peak: int
    total: int


def read_memory(device: torch.device, host: HostMemory | None = None) -> MemoryReading:
    """CUDA: the caching allocator's counters. CPU: the process's resident set, and the memory
    the host gives it (a container's cgroup limit, as memory planning budgets from)."""
    if device.type == "cuda":
        index = device.index or 0
        return MemoryReading(
            allocated=torch.cuda.memory_allocated(index),
            reserved=torch.cuda.memory_reserved(index),
            peak=torch.cuda.max_memory_allocated(index),
            total=torch.cuda.get_device_properties(index).total_memory,
        )
    host = host or HostMemory()
    resident = host.allocated_bytes()
    return MemoryReading(
        allocated=resident,
        reserved=resident,
        peak=max(resident, host.peak_allocated_bytes()),
        total=host.total_bytes(),
    )
