"""CUDA shared-memory regions (Triton's extension) in the serving core: device memory a client
allocated and shared by its IPC handle, opened on the device it names, read for inputs and
written for outputs.

nograd's model inputs are host (numpy) arrays until the batcher collates them, so an input is
copied device to host when its request is decoded and an output host to device when its answer
is encoded; what a model then does on its own device is the runtime's business. Every worker
opens the handle itself (a handle may be opened by several processes), and closes it when the
region is unregistered or the server stops; a copy in flight finishes before its region closes.

The CUDA runtime comes from ``nograd.host.cuda_ipc`` through ``CudaMemory``, so the region table
and its bounds checks are tested without a GPU.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
from collections.abc import Callable
from typing import Any, Final, Protocol

from nograd.host.cuda_ipc import IPC_HANDLE_SIZE, CudaError, CudaUnavailable
from nograd.serving.errors import InvalidInput, RegionNotFound

logger = logging.getLogger(__name__)

KIND: Final = "cuda"


class CudaMemory(Protocol):
    """The CUDA calls a region makes (``nograd.host.cuda_ipc.CudaRuntime``)."""

    def device_count(self) -> int: ...

    def open_handle(self, handle: bytes, device: int) -> int: ...

    def allocation_size(self, pointer: int) -> int | None: ...

    def close_handle(self, pointer: int, device: int) -> None: ...

    def to_host(self, pointer: int, device: int, byte_size: int) -> bytearray: ...

    def from_host(self, pointer: int, device: int, data: bytes | memoryview) -> None: ...


CudaOpener = Callable[[], CudaMemory]
"""This process's CUDA runtime; raises ``CudaUnavailable`` on a server without a GPU."""


def cuda_refusal(name: str) -> str:
    """Triton's answer to registering a CUDA region on a server without GPU support."""
    return f"failed to register CUDA shared memory region: '{name}', GPUs not supported"


def decode_handle(name: str, b64: Any) -> bytes:
    """A ``raw_handle`` as HTTP carries it (base64 text), checked to be one IPC handle."""
    try:
        if not isinstance(b64, str):
            raise ValueError(b64)
        raw = base64.b64decode(b64, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise InvalidInput(
            f"'raw_handle' of CUDA shared memory region '{name}' is not valid base64"
        ) from exc
    return raw


def _whole(value: Any, field: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(
            f"failed to register CUDA shared memory region '{name}': {field} must be a "
            f"non-negative integer, got {value!r}"
        )
    return value


class CudaRegion:
    """One opened IPC handle: ``byte_size`` bytes of device ``device_id``'s memory."""

    kind: Final = KIND

    def __init__(
        self,
        name: str,
        raw_handle: bytes,
        device_id: int,
        byte_size: int,
        pointer: int,
        memory: CudaMemory,
    ) -> None:
        self.name, self.raw_handle, self.device_id = name, raw_handle, device_id
        self.byte_size, self._pointer, self._memory = byte_size, pointer, memory
        self._lock = threading.Lock()
        self._open = True

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def record(self) -> dict[str, Any]:
        """What another worker needs to open the same region."""
        handle = base64.b64encode(self.raw_handle).decode()
        return {"kind": KIND, "raw_handle": handle} | self.status()

    def read(self, offset: int, byte_size: int) -> bytearray:
        with self._lock:
            self._require_open()
            try:
                return self._memory.to_host(self._pointer + offset, self.device_id, byte_size)
            except CudaError as exc:
                raise InvalidInput(f"CUDA shared memory region '{self.name}': {exc}") from exc

    def write(self, offset: int, data: bytes | memoryview) -> None:
        with self._lock:
            self._require_open()
            try:
                self._memory.from_host(self._pointer + offset, self.device_id, data)
            except CudaError as exc:
                raise InvalidInput(f"CUDA shared memory region '{self.name}': {exc}") from exc

    def _require_open(self) -> None:
        if not self._open:
            raise RegionNotFound(f"Unable to find shared memory region: '{self.name}'")

    def close(self) -> None:
        """Close the handle, once a copy in flight finished; a failure is logged (the region
        goes either way: nothing could be done with it)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            try:
                self._memory.close_handle(self._pointer, self.device_id)
            except CudaError:
                logger.exception("CUDA shared memory region '%s' not closed cleanly", self.name)


def open_region(
    opener: CudaOpener, name: str, raw_handle: Any, device_id: Any, byte_size: Any
) -> CudaRegion:
    """Open a client's IPC handle on its device, every argument checked first (Triton's errors,
    CUDA's own reason after them)."""
    try:
        memory = opener()
    except CudaUnavailable as exc:
        raise InvalidInput(cuda_refusal(name)) from exc
    if not isinstance(raw_handle, bytes) or len(raw_handle) != IPC_HANDLE_SIZE:
        raise InvalidInput("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
    device_id = _whole(device_id, "device_id", name)
    byte_size = _whole(byte_size, "byte_size", name)
    invalid = f"failed to register shared memory region '{name}': invalid args"
    if byte_size == 0:
        raise InvalidInput(invalid)
    try:
        devices = memory.device_count()
        if device_id >= devices:
            raise InvalidInput(
                f"{invalid}: device_id {device_id} names no GPU (this server sees {devices})"
            )
        pointer = memory.open_handle(raw_handle, device_id)
    except CudaError as exc:
        raise InvalidInput(
            f"failed to register shared memory region: invalid args ({exc})"
        ) from exc
    region = CudaRegion(name, raw_handle, device_id, byte_size, pointer, memory)
    try:
        allocated = memory.allocation_size(pointer)
    except CudaError as exc:
        region.close()
        raise InvalidInput(f"{invalid} ({exc})") from exc
    if allocated is not None and byte_size > allocated:
        region.close()
        raise InvalidInput(
            f"{invalid}: byte_size {byte_size} is past the end of the client's "
            f"allocation ({allocated} bytes)"
        )
    return region
