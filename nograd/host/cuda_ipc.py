"""The CUDA runtime calls Triton's CUDA shared-memory extension needs, through ctypes: a client's
IPC handle opened (``cudaIpcOpenMemHandle``) and closed, and bytes copied between that device
memory and host buffers.

ctypes on ``libcudart`` instead of torch: the serving and protocol layers import no torch, and a
server whose models run on the CPU still serves clients that keep their tensors on a GPU. The
library torch already loaded in this process is preferred (one runtime per process), then the
ones the nvidia wheels and the CUDA toolkit install, then the loader's search path. No runtime, or
no GPU (``cudaGetDeviceCount``), is ``CudaUnavailable``; a failed call is ``CudaError`` naming the
call and CUDA's own error string. Nothing here runs until a CUDA region is registered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
from pathlib import Path
from typing import Final

import numpy as np

IPC_HANDLE_SIZE: Final = 64
"""Bytes of a ``cudaIpcMemHandle_t`` (``CUDA_IPC_HANDLE_SIZE``)."""
_LAZY_ENABLE_PEER_ACCESS: Final = 1  # cudaIpcMemLazyEnablePeerAccess, as Triton opens handles
_HOST_TO_DEVICE: Final = 1  # cudaMemcpyHostToDevice
_DEVICE_TO_HOST: Final = 2  # cudaMemcpyDeviceToHost
_SONAMES: Final = ("libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so")
_WHEEL_LIBRARIES: Final = ("cuda_runtime/lib/libcudart.so.12", "cu13/lib/libcudart.so.13")
_TOOLKITS: Final = ("/usr/local/cuda/lib64", "/usr/local/cuda/lib")


class CudaUnavailable(Exception):
    """No CUDA runtime library, or one that sees no GPU."""


class CudaError(Exception):
    """A CUDA call failed; the message names the call and CUDA's error string."""


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


def _loaded_runtime() -> list[str]:
    """The ``libcudart`` this process already mapped (torch's), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = {line.split()[-1] for line in maps.splitlines() if "/libcudart" in line}
    return sorted(path for path in found if path.startswith("/"))


def _installed_runtimes() -> list[str]:
    """Where the nvidia wheels, torch's own ``lib`` folder and the toolkit put ``libcudart``;
    looked up without importing any of them."""
    candidates: list[Path] = []
    nvidia = importlib.util.find_spec("nvidia")
    for folder in (nvidia.submodule_search_locations or []) if nvidia else []:
        candidates += [Path(folder) / each for each in _WHEEL_LIBRARIES]
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.origin is not None:
        candidates += sorted((Path(torch.origin).parent / "lib").glob("libcudart*.so*"))
    for folder in _TOOLKITS:
        candidates += sorted(Path(folder).glob("libcudart.so*"))
    return [str(path) for path in candidates if path.is_file()]


def library_candidates() -> list[str]:
    """Every ``libcudart`` to try, in order."""
    found = ctypes.util.find_library("cudart")
    names = [*_loaded_runtime(), *_installed_runtimes(), *_SONAMES]
    return names + ([found] if found else [])


def _open_library() -> ctypes.CDLL:
    for name in library_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CudaUnavailable("no CUDA runtime library (libcudart) found")


class CudaRuntime:
    """One process's CUDA runtime, for device memory other processes shared by IPC handle."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = lib = library
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaIpcOpenMemHandle.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            _IpcMemHandle,
            ctypes.c_uint,
        ]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaGetLastError.argtypes = []
        for function in (
            lib.cudaGetDeviceCount,
            lib.cudaSetDevice,
            lib.cudaIpcOpenMemHandle,
            lib.cudaIpcCloseMemHandle,
            lib.cudaMemcpy,
            lib.cudaStreamSynchronize,
            lib.cudaGetLastError,
        ):
            function.restype = ctypes.c_int
        self._driver = _driver()

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            self._lib.cudaGetLastError()  # a failed call's error is not left for the next
            text = self._lib.cudaGetErrorString(status) or b"unknown error"
            raise CudaError(f"{call} failed: {text.decode(errors='replace')} ({status})")

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._check(self._lib.cudaGetDeviceCount(ctypes.byref(count)), "cudaGetDeviceCount")
        return count.value

    def open_handle(self, handle: bytes, device: int) -> int:
        """The device address another process's allocation maps to in this one."""
        if len(handle) != IPC_HANDLE_SIZE:
            raise CudaError(f"an IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        pointer = ctypes.c_void_p()
        raw = _IpcMemHandle.from_buffer_copy(handle)
        status = self._lib.cudaIpcOpenMemHandle(
            ctypes.byref(pointer), raw, _LAZY_ENABLE_PEER_ACCESS
        )
        self._check(status, "cudaIpcOpenMemHandle")
        return int(pointer.value or 0)

    def allocation_size(self, pointer: int) -> int | None:
        """Bytes of the allocation ``pointer`` lies in (the driver's ``cuMemGetAddressRange``);
        None where the driver library cannot be called."""
        if self._driver is None:
            return None
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        status = self._driver.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer)
        )
        if status != 0:
            raise CudaError(f"cuMemGetAddressRange failed ({status})")
        return int(size.value) - (pointer - int(base.value))

    def close_handle(self, pointer: int, device: int) -> None:
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        self._check(self._lib.cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")

    def to_host(self, pointer: int, device: int, byte_size: int) -> bytearray:
        """``byte_size`` bytes at device address ``pointer``, copied into host memory (the copy
        from pageable memory returns once it completed)."""
        data = bytearray(byte_size)
        if byte_size == 0:
            return data
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        host = (ctypes.c_char * byte_size).from_buffer(data)
        self._check(
            self._lib.cudaMemcpy(ctypes.addressof(host), pointer, byte_size, _DEVICE_TO_HOST),
            "cudaMemcpy (device to host)",
        )
        return data

    def from_host(self, pointer: int, device: int, data: bytes | memoryview) -> None:
        """``data`` copied to device address ``pointer``, complete on return: a copy from
        pageable memory may still be in flight when ``cudaMemcpy`` returns, and the client reads
        the region as soon as it has the response."""
        host = np.frombuffer(data, dtype=np.uint8)
        if host.size == 0:
            return
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")
        self._check(
            self._lib.cudaMemcpy(pointer, host.ctypes.data, host.size, _HOST_TO_DEVICE),
            "cudaMemcpy (host to device)",
        )
        self._check(self._lib.cudaStreamSynchronize(None), "cudaStreamSynchronize")


def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library (present wherever a GPU is), for allocation sizes."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    return driver


def cuda_runtime() -> CudaRuntime:
    """This process's CUDA runtime, once it sees at least one GPU (probed once, then kept)."""
    found = _probe()
    if isinstance(found, CudaUnavailable):
        raise CudaUnavailable(str(found))
    return found


@functools.cache
def _probe() -> CudaRuntime | CudaUnavailable:
    try:
        runtime = CudaRuntime(_open_library())
        count = runtime.device_count()
    except CudaUnavailable as exc:
        return exc
    except (CudaError, AttributeError) as exc:  # no driver or device; a library too old
        return CudaUnavailable(str(exc))
    if count < 1:
        return CudaUnavailable("the CUDA runtime sees no GPU")
    return runtime
