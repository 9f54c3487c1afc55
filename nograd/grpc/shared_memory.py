"""The shared-memory extensions' RPCs of Triton's GRPCInferenceService (``SystemSharedMemory*``
and ``CudaSharedMemory*``), as tritonclient's ``register/unregister/get_*_shared_memory*`` call
them; ``InferenceService`` takes them from here. The regions live in the serving core; each call
acts on its caller's regions only (the API key it carries)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.rpc import CallContext
from nograd.serving.core import Core
from nograd.serving.extensions.cuda_shared_memory import KIND as CUDA

Reply = TypeVar("Reply", bound=Message)


class SharedMemoryRpcs:
    """Register, unregister and status of both kinds, answered through the service's
    ``_answer``."""

    _core: Core

    async def _answer(
        self, context: CallContext, work: Callable[[], Awaitable[Reply]], *, health: bool = False
    ) -> Reply:
        raise NotImplementedError

    def _caller(self, context: CallContext) -> str:
        raise NotImplementedError

    async def SystemSharedMemoryStatus(
        self, request: Any, context: CallContext
    ) -> pb.SystemSharedMemoryStatusResponse:
        async def status() -> pb.SystemSharedMemoryStatusResponse:
            regions = self._core.calls.shared_memory.status(
                request.name or None, caller=self._caller(context)
            )
            status = pb.SystemSharedMemoryStatusResponse.RegionStatus
            return pb.SystemSharedMemoryStatusResponse(
                regions={r["name"]: status(**r) for r in regions}
            )

        return await self._answer(context, status)

    async def SystemSharedMemoryRegister(
        self, request: Any, context: CallContext
    ) -> pb.SystemSharedMemoryRegisterResponse:
        async def register() -> pb.SystemSharedMemoryRegisterResponse:
            await self._core.calls.shared_memory.register(
                request.name, request.key, request.offset, request.byte_size, self._caller(context)
            )
            return pb.SystemSharedMemoryRegisterResponse()

        return await self._answer(context, register)

    async def SystemSharedMemoryUnregister(
        self, request: Any, context: CallContext
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        async def unregister() -> pb.SystemSharedMemoryUnregisterResponse:
            await self._core.calls.shared_memory.unregister(
                request.name or None, caller=self._caller(context)
            )
            return pb.SystemSharedMemoryUnregisterResponse()

        return await self._answer(context, unregister)

    async def CudaSharedMemoryStatus(
        self, request: Any, context: CallContext
    ) -> pb.CudaSharedMemoryStatusResponse:
        async def status() -> pb.CudaSharedMemoryStatusResponse:
            regions = self._core.calls.shared_memory.status(
                request.name or None, CUDA, self._caller(context)
            )
            status = pb.CudaSharedMemoryStatusResponse.RegionStatus
            return pb.CudaSharedMemoryStatusResponse(
                regions={r["name"]: status(**r) for r in regions}
            )

        return await self._answer(context, status)

    async def CudaSharedMemoryRegister(
        self, request: Any, context: CallContext
    ) -> pb.CudaSharedMemoryRegisterResponse:
        async def register() -> pb.CudaSharedMemoryRegisterResponse:
            await self._core.calls.shared_memory.register_cuda(
                request.name,
                request.raw_handle,
                request.device_id,
                request.byte_size,
                self._caller(context),
            )
            return pb.CudaSharedMemoryRegisterResponse()

        return await self._answer(context, register)

    async def CudaSharedMemoryUnregister(
        self, request: Any, context: CallContext
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        async def unregister() -> pb.CudaSharedMemoryUnregisterResponse:
            await self._core.calls.shared_memory.unregister(
                request.name or None, CUDA, self._caller(context)
            )
            return pb.CudaSharedMemoryUnregisterResponse()

        return await self._answer(context, unregister)
