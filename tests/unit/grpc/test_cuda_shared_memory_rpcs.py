"""The ``CudaSharedMemory*`` RPCs of the gRPC front over a real serving core whose CUDA runtime is
faked (``tests.unit.fake_cuda``): the raw handle bytes registered as tritonclient sends them, the
status map, unregister closing the handle; a handle of the wrong size and a server without a GPU
answered INVALID_ARGUMENT with Triton's words."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.host.cuda_ipc import IPC_HANDLE_SIZE
from nograd.serving.core import Core
from nograd.serving.extensions.shared_memory import SharedMemory
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES
from tests.unit.fake_cuda import FakeDevice, no_gpu
from tests.unit.grpc.test_service_answers import front, stub

HANDLE = bytes(range(IPC_HANDLE_SIZE))


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "no-gpu"])
async def test_cuda_rpcs(tmp_path: Path, gpu: bool) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    core = Core(Settings(model_repository=repo, warmup=False))
    device = FakeDevice()
    device.allocate(HANDLE, 64)
    core.calls.shared_memory = SharedMemory(cuda_opener=(lambda: device) if gpu else no_gpu)
    async with front(core) as address, grpc.aio.insecure_channel(address) as channel:
        register = stub(
            channel,
            "CudaSharedMemoryRegister",
            pb.CudaSharedMemoryRegisterRequest,
            pb.CudaSharedMemoryRegisterResponse,
        )
        status = stub(
            channel,
            "CudaSharedMemoryStatus",
            pb.CudaSharedMemoryStatusRequest,
            pb.CudaSharedMemoryStatusResponse,
        )
        unregister = stub(
            channel,
            "CudaSharedMemoryUnregister",
            pb.CudaSharedMemoryUnregisterRequest,
            pb.CudaSharedMemoryUnregisterResponse,
        )
        request = pb.CudaSharedMemoryRegisterRequest(
            name="r", raw_handle=HANDLE, device_id=0, byte_size=64
        )
        if not gpu:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await register(request, timeout=10)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == (
                "failed to register CUDA shared memory region: 'r', GPUs not supported"
            )
            assert not (await status(pb.CudaSharedMemoryStatusRequest(), timeout=10)).regions
            await unregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=10)
            return
        short = pb.CudaSharedMemoryRegisterRequest(name="s", raw_handle=b"x", byte_size=8)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await register(short, timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "cudaIpcMemHandle_t" in (refused.value.details() or "")
        await register(request, timeout=10)
        answer = await status(pb.CudaSharedMemoryStatusRequest(name="r"), timeout=10)
        assert answer.regions["r"].byte_size == 64 and answer.regions["r"].device_id == 0
        await unregister(pb.CudaSharedMemoryUnregisterRequest(name="r"), timeout=10)
        assert not (await status(pb.CudaSharedMemoryStatusRequest(), timeout=10)).regions
        assert not device.opened
