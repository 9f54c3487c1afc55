"""A faked CUDA runtime behind ``nograd.serving.extensions.cuda_shared_memory.CudaMemory``: a
client's device memory by IPC handle, as every process that opens it sees it, with every copy
checked to stay inside its allocation."""

from __future__ import annotations

from nograd.host.cuda_ipc import CudaError, CudaUnavailable


class FakeDevice:
    """Device memory of one client, by IPC handle, as every process that opens it sees it."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.allocations: dict[bytes, bytearray] = {}
        self.opened: dict[int, bytes] = {}
        self.closed: list[int] = []
        self._next = 0x1000_0000

    def allocate(self, handle: bytes, size: int) -> bytearray:
        self.allocations[handle] = bytearray(size)
        return self.allocations[handle]

    def device_count(self) -> int:
        return self.devices

    def open_handle(self, handle: bytes, device: int) -> int:
        if handle not in self.allocations:
            raise CudaError("cudaIpcOpenMemHandle failed: invalid argument (1)")
        self._next += 0x100_0000
        self.opened[self._next] = handle
        return self._next

    def _at(self, pointer: int) -> tuple[bytearray, int]:
        base = max(p for p in self.opened if p <= pointer)
        return self.allocations[self.opened[base]], pointer - base

    def allocation_size(self, pointer: int) -> int | None:
        memory, offset = self._at(pointer)
        return len(memory) - offset

    def close_handle(self, pointer: int, device: int) -> None:
        del self.opened[pointer]
        self.closed.append(pointer)

    def to_host(self, pointer: int, device: int, byte_size: int) -> bytearray:
        memory, offset = self._at(pointer)
        assert offset + byte_size <= len(memory), "read outside the allocation"
        return bytearray(memory[offset : offset + byte_size])

    def from_host(self, pointer: int, device: int, data: bytes | memoryview) -> None:
        memory, offset = self._at(pointer)
        assert offset + len(data) <= len(memory), "write outside the allocation"
        memory[offset : offset + len(data)] = data


def no_gpu() -> FakeDevice:
    raise CudaUnavailable("cudaGetDeviceCount failed: no CUDA-capable device is detected (100)")
