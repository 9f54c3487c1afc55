"""The CUDA shared-memory routes of the HTTP front over a real serving core whose CUDA runtime is
faked (``tests.unit.fake_cuda``): the register body read as tritonclient sends it, Triton's
errors for a malformed one, an inference reading its input from a
region and writing its output into one, status and unregister. The real runtime's path runs in
tests/e2e/test_cuda_shared_memory.py, on a GPU."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from nograd.host.cuda_ipc import IPC_HANDLE_SIZE
from nograd.http.app import create_app
from nograd.serving.extensions.shared_memory import SharedMemory
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES
from tests.unit.fake_cuda import FakeDevice, no_gpu

HANDLE = bytes(range(IPC_HANDLE_SIZE))
B64 = base64.b64encode(HANDLE).decode()
X = np.array([[1.5, 2.5]], dtype=np.float32)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, device: Any) -> AsyncIterator[httpx.AsyncClient]:
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    app: FastAPI = create_app(Settings(model_repository=repo, warmup=False))
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app.state.dataplane.until_loaded(), 30)
        app.state.calls.shared_memory = SharedMemory(cuda_opener=device)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://nograd") as client:
            yield client
        app.state.calls.shared_memory.close()


async def test_a_region_registered_over_http_serves_an_inference(tmp_path: Path) -> None:
    device = FakeDevice()
    memory = device.allocate(HANDLE, 16)
    memory[:8] = X.tobytes()
    async with serving(tmp_path, lambda: device) as client:
        body = {"raw_handle": {"b64": B64}, "device_id": 0, "byte_size": 16}
        answer = await client.post("/v2/cudasharedmemory/region/r/register", json=body)
        assert answer.status_code == 200, answer.text
        status = await client.get("/v2/cudasharedmemory/status")
        assert status.json() == [{"name": "r", "device_id": 0, "byte_size": 16}]
        one = await client.get("/v2/cudasharedmemory/region/r/status")
        assert one.json() == status.json()
        request = {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 2],
                    "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
                }
            ],
            "outputs": [
                {
                    "name": "y",
                    "parameters": {
                        "shared_memory_region": "r",
                        "shared_memory_offset": 8,
                        "shared_memory_byte_size": 8,
                    },
                }
            ],
        }
        answer = await client.post("/v2/models/poison/infer", json=request)
        assert answer.status_code == 200, answer.text
        assert "data" not in answer.json()["outputs"][0]
        np.testing.assert_array_equal(np.frombuffer(memory[8:], np.float32), X[0] * 2)
        assert (await client.post("/v2/cudasharedmemory/region/r/unregister")).status_code == 200
        assert (await client.get("/v2/cudasharedmemory/status")).json() == []
        assert not device.opened


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({}, "Shared memory register request has no 'raw_handle' field"),
        ({"raw_handle": B64, "device_id": 0, "byte_size": 8}, "'raw_handle' must be a JSON object"),
        ({"raw_handle": {"b64": "%%%"}, "device_id": 0, "byte_size": 8}, "is not valid base64"),
        ({"raw_handle": {"b64": B64[:20]}, "device_id": 0, "byte_size": 8}, "cudaIpcMemHandle_t"),
        ({"raw_handle": {"b64": B64}, "byte_size": 8}, "'raw_handle', 'device_id' and 'byte_size'"),
        ({"raw_handle": {"b64": B64}, "device_id": 0, "byte_size": 17}, "invalid args"),
        ({"raw_handle": {"b64": B64}, "device_id": 0, "byte_size": "8"}, "non-negative integer"),
    ],
)
async def test_malformed_registrations_are_a_clear_400(
    tmp_path: Path, body: dict[str, Any], error: str
) -> None:
    device = FakeDevice()
    device.allocate(HANDLE, 16)
    async with serving(tmp_path, lambda: device) as client:
        answer = await client.post("/v2/cudasharedmemory/region/r/register", json=body)
        assert answer.status_code == 400
        assert error in answer.json()["error"]
        assert not device.opened


async def test_without_a_gpu_register_is_refused_whatever_the_body(tmp_path: Path) -> None:
    async with serving(tmp_path, no_gpu) as client:
        answer = await client.post("/v2/cudasharedmemory/region/r/register", content=b"not json")
        assert answer.status_code == 400
        assert answer.json()["error"] == (
            "failed to register CUDA shared memory region: 'r', GPUs not supported"
        )
        assert (await client.post("/v2/cudasharedmemory/unregister")).status_code == 200
        missing = await client.get("/v2/cudasharedmemory/region/r/status")
        assert "Unable to find cuda shared memory region: 'r'" in missing.json()["error"]
