"""The CUDA runtime through ctypes, as far as a machine without a GPU exercises it: the probe says
unavailable (with the runtime's own reason where a libcudart is installed), and a failed call is
an error naming the call and CUDA's error string. The calls on a GPU are exercised by
tests/e2e/test_cuda_shared_memory.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nograd.host import cuda_ipc
from nograd.host.cuda_ipc import IPC_HANDLE_SIZE, CudaError, CudaRuntime, CudaUnavailable

ERRORS = {0: b"no error", 201: b"invalid device context", 100: b"no CUDA-capable device"}


class FakeRuntime:
    """A ``libcudart`` whose calls answer the status codes given (0: success)."""

    def __init__(self, **status: int) -> None:
        self._status = status

    def __getattr__(self, name: str) -> Any:
        if name == "cudaGetErrorString":

            def error_string(code: int) -> bytes:
                return ERRORS.get(code, b"unknown error")

            function: Any = error_string
        else:

            def call(*args: Any) -> int:
                return self._status.get(name, 0)

            function = call
        setattr(self, name, function)
        return function


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU is present")
def test_without_a_gpu_the_runtime_is_unavailable() -> None:
    with pytest.raises(CudaUnavailable):
        cuda_ipc.cuda_runtime()
    with pytest.raises(CudaUnavailable):  # probed once, answered alike after
        cuda_ipc.cuda_runtime()


def test_the_loader_search_comes_last() -> None:
    candidates = cuda_ipc.library_candidates()
    assert "libcudart.so.12" in candidates
    assert candidates.index("libcudart.so.12") > max(
        (i for i, name in enumerate(candidates) if name.startswith("/")), default=-1
    )


def test_a_failed_call_names_the_call_and_cudas_reason() -> None:
    runtime = CudaRuntime(FakeRuntime(cudaIpcOpenMemHandle=201))  # type: ignore[arg-type]
    with pytest.raises(CudaError) as failed:
        runtime.open_handle(b"x" * IPC_HANDLE_SIZE, 0)
    assert str(failed.value) == "cudaIpcOpenMemHandle failed: invalid device context (201)"
    with pytest.raises(CudaError, match="an IPC handle is 64 bytes, got 3"):
        runtime.open_handle(b"abc", 0)
    no_device = CudaRuntime(FakeRuntime(cudaGetDeviceCount=100))  # type: ignore[arg-type]
    with pytest.raises(CudaError, match="no CUDA-capable device"):
        no_device.device_count()
