"""Whether the CUDA shared-memory tests can run here: a GPU the CUDA runtime sees (the same probe
the server makes, ``nograd.host.cuda_ipc``) and tritonclient's CUDA utilities (cuda-python)."""

from __future__ import annotations

from nograd.host.cuda_ipc import CudaUnavailable, cuda_runtime


def gpu_missing() -> str:
    """Why the server here would refuse CUDA regions; empty when it sees a GPU."""
    try:
        cuda_runtime()
    except CudaUnavailable as exc:
        return f"needs a CUDA GPU ({exc})"
    return ""


def cuda_shared_memory_missing() -> str:
    """Why the CUDA shared-memory tests cannot run here; empty when they can."""
    if missing := gpu_missing():
        return missing
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except (ImportError, RuntimeError):  # RuntimeError: cuda-python is not installed
        return "needs cuda-python (tritonclient.utils.cuda_shared_memory)"
    return ""
