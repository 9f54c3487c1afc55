"""The ``SystemSharedMemory*`` RPCs and ModelInfer over the real gRPC front with two API keys: a
region one key registered is absent from the other's status, untouched by its unregister calls
and unknown to its inferences, which the owner's inference reads and writes."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pydantic import SecretStr

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.serving.core import Core
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES
from tests.unit.grpc.test_service_answers import front, refused, stub

X = np.array([[1.5, 2.5]], dtype=np.float32)
ALICE = (("authorization", "Bearer alice-key"),)
BOB = (("authorization", "Bearer bob-key"),)


@pytest.fixture
def shm_object() -> Iterator[Path]:
    path = Path("/dev/shm") / f"nograd_grpc_iso_{uuid.uuid4().hex[:8]}"
    path.write_bytes(X.tobytes() + bytes(8))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _output_bytes(path: Path) -> bytes:
    """What the object holds after the input: where the outputs are written."""
    return path.read_bytes()[8:]


def _infer_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="poison")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].int64_param = 8
    output = request.outputs.add(name="y")
    output.parameters["shared_memory_region"].string_param = "r"
    output.parameters["shared_memory_offset"].int64_param = 8
    output.parameters["shared_memory_byte_size"].int64_param = 8
    return request


async def test_regions_are_their_callers_own_over_grpc(tmp_path: Path, shm_object: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    settings = Settings(
        model_repository=repo, warmup=False, operator_api_keys=SecretStr("alice-key,bob-key")
    )
    core = Core(settings)
    async with front(core) as address, grpc.aio.insecure_channel(address) as channel:
        register = stub(
            channel,
            "SystemSharedMemoryRegister",
            pb.SystemSharedMemoryRegisterRequest,
            pb.SystemSharedMemoryRegisterResponse,
        )
        status = stub(
            channel,
            "SystemSharedMemoryStatus",
            pb.SystemSharedMemoryStatusRequest,
            pb.SystemSharedMemoryStatusResponse,
        )
        unregister = stub(
            channel,
            "SystemSharedMemoryUnregister",
            pb.SystemSharedMemoryUnregisterRequest,
            pb.SystemSharedMemoryUnregisterResponse,
        )
        infer = stub(channel, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        key = f"/{shm_object.name}"
        await register(
            pb.SystemSharedMemoryRegisterRequest(name="r", key=key, byte_size=16),
            metadata=ALICE,
            timeout=10,
        )
        everyone = pb.SystemSharedMemoryStatusRequest()
        assert list((await status(everyone, metadata=ALICE, timeout=10)).regions) == ["r"]
        assert not (await status(everyone, metadata=BOB, timeout=10)).regions
        named = await refused(status, pb.SystemSharedMemoryStatusRequest(name="r"), metadata=BOB)
        assert named.code() == grpc.StatusCode.NOT_FOUND
        used = await refused(infer, _infer_request(), metadata=BOB)
        assert used.code() == grpc.StatusCode.NOT_FOUND
        assert used.details() == "Unable to find shared memory region: 'r'"
        assert _output_bytes(shm_object) == bytes(8)
        await unregister(pb.SystemSharedMemoryUnregisterRequest(name="r"), metadata=BOB, timeout=10)
        await unregister(pb.SystemSharedMemoryUnregisterRequest(), metadata=BOB, timeout=10)
        assert list((await status(everyone, metadata=ALICE, timeout=10)).regions) == ["r"]
        await infer(_infer_request(), metadata=ALICE, timeout=10)
        written = np.frombuffer(_output_bytes(shm_object), np.float32)
        np.testing.assert_array_equal(written, X[0] * 2)
        await unregister(pb.SystemSharedMemoryUnregisterRequest(), metadata=ALICE, timeout=10)
        assert not (await status(everyone, metadata=ALICE, timeout=10)).regions
