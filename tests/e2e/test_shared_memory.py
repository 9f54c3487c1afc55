"""Triton's system shared-memory extension with tritonclient's own shared-memory utilities, over
HTTP and gRPC: inputs read from and outputs written into registered regions (fixed-size and
BYTES), the status and unregister calls, and bounds refused cleanly; with two workers a
registration made through one is used through every connection."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
    serialized_byte_size,
)

from tests.e2e.cuda import gpu_missing
from tests.e2e.serving import Server
from tests.e2e.shared_memory import assert_outside_offsets_refused, simple_server

pytestmark = pytest.mark.e2e

ROWS = np.arange(16, dtype=np.int32).reshape(1, 16)
ONES = np.ones((1, 16), dtype=np.int32)
SIZE = ROWS.nbytes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with simple_server(tmp_path_factory.mktemp("shm")) as running:
        yield running


@pytest.fixture
def regions() -> Iterator[tuple[str, shm.SharedMemoryRegion, shm.SharedMemoryRegion]]:
    """An input region holding ROWS then ONES, and an output region of two tensors."""
    tag = uuid.uuid4().hex[:8]
    inputs = shm.create_shared_memory_region(f"in_{tag}", f"/nograd_in_{tag}", 2 * SIZE)
    outputs = shm.create_shared_memory_region(f"out_{tag}", f"/nograd_out_{tag}", 2 * SIZE)
    shm.set_shared_memory_region(inputs, [ROWS, ONES])
    try:
        yield tag, inputs, outputs
    finally:
        shm.destroy_shared_memory_region(inputs)
        shm.destroy_shared_memory_region(outputs)


def _http_infer(client: triton_http.InferenceServerClient, tag: str) -> None:
    inputs = [triton_http.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory(f"in_{tag}", SIZE)
    inputs[1].set_shared_memory(f"in_{tag}", SIZE, offset=SIZE)
    outputs = [triton_http.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory(f"out_{tag}", SIZE)
    outputs[1].set_shared_memory(f"out_{tag}", SIZE, offset=SIZE)
    result = client.infer("simple", inputs, outputs=outputs)
    answer = result.get_output("OUTPUT0")
    assert "data" not in answer  # in the region, not the body
    assert answer["parameters"]["shared_memory_region"] == f"out_{tag}"


def test_http_fixed_size_inputs_and_outputs_in_shared_memory(server: Server, regions) -> None:
    tag, _, outputs = regions
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    client.register_system_shared_memory(f"in_{tag}", f"/nograd_in_{tag}", 2 * SIZE)
    client.register_system_shared_memory(f"out_{tag}", f"/nograd_out_{tag}", 2 * SIZE)
    try:
        status = {r["name"]: r for r in client.get_system_shared_memory_status()}
        assert status[f"in_{tag}"] == {
            "name": f"in_{tag}",
            "key": f"/nograd_in_{tag}",
            "offset": 0,
            "byte_size": 2 * SIZE,
        }
        _http_infer(client, tag)
        total = shm.get_contents_as_numpy(outputs, np.int32, [1, 16])
        difference = shm.get_contents_as_numpy(outputs, np.int32, [1, 16], offset=SIZE)
        np.testing.assert_array_equal(total, ROWS + ONES)
        np.testing.assert_array_equal(difference, ROWS - ONES)
        with pytest.raises(InferenceServerException, match="already in manager"):
            client.register_system_shared_memory(f"in_{tag}", f"/nograd_in_{tag}", SIZE)
        # System and CUDA regions share their names, as in Triton; each kind's calls keep to it.
        other_kind = "registered as system shared memory, not CUDA shared memory"
        with pytest.raises(InferenceServerException, match=other_kind):
            client.get_cuda_shared_memory_status(f"in_{tag}")
        client.unregister_cuda_shared_memory(f"in_{tag}")
        client.unregister_cuda_shared_memory()
        assert len(client.get_system_shared_memory_status()) == 2
    finally:
        client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []
    # A region used after it was unregistered is a clean error naming it.
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
        _http_infer(client, tag)
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()


def test_bounds_outside_a_region_are_refused(server: Server, regions) -> None:
    tag, _, _ = regions
    url = server.url
    body = {"key": f"/nograd_in_{tag}", "offset": SIZE, "byte_size": 2 * SIZE}
    past_end = httpx.post(f"{url}/v2/systemsharedmemory/region/in_{tag}/register", json=body)
    assert past_end.status_code == 400
    invalid = f"failed to register shared memory region 'in_{tag}': invalid args"
    assert past_end.json()["error"] == invalid
    unknown = {"key": "/nograd_no_such_key", "byte_size": 8}
    missing = httpx.post(f"{url}/v2/systemsharedmemory/region/x_{tag}/register", json=unknown)
    assert missing.status_code == 400
    assert "Unable to open shared memory region: '/nograd_no_such_key'" in missing.text
    ok = {"key": f"/nograd_in_{tag}", "offset": 0, "byte_size": SIZE}
    registered = httpx.post(f"{url}/v2/systemsharedmemory/region/in_{tag}/register", json=ok)
    assert registered.status_code == 200, registered.text
    try:
        assert_outside_offsets_refused(url, f"in_{tag}", SIZE)
        half = {"shared_memory_region": f"in_{tag}", "shared_memory_byte_size": SIZE // 2}
        request = {
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [1, 16], "parameters": half}
                for n in ("INPUT0", "INPUT1")
            ]
        }
        answer = httpx.post(f"{url}/v2/models/simple/infer", json=request)
        assert answer.status_code == 400
        assert f"Expected {SIZE}, got {SIZE // 2}" in answer.json()["error"]
    finally:
        httpx.post(f"{url}/v2/systemsharedmemory/region/in_{tag}/unregister")
    cuda = httpx.post(f"{url}/v2/cudasharedmemory/region/c/register", json={})
    refusal = "has no 'raw_handle' field" if not gpu_missing() else "GPUs not supported"
    assert cuda.status_code == 400 and refusal in cuda.text


def test_grpc_bytes_in_shared_memory(server: Server) -> None:
    assert server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    tag = uuid.uuid4().hex[:8]
    strings = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    ones = np.array([[b"1"] * 16], dtype=np.object_)
    first, second = serialize_byte_tensor(strings), serialize_byte_tensor(ones)
    first_size, second_size = serialized_byte_size(first), serialized_byte_size(second)
    both = first_size + second_size
    region_in = shm.create_shared_memory_region(f"sin_{tag}", f"/nograd_sin_{tag}", both)
    region_out = shm.create_shared_memory_region(f"sout_{tag}", f"/nograd_sout_{tag}", 512)
    try:
        shm.set_shared_memory_region(region_in, [first, second])
        client.register_system_shared_memory(f"sin_{tag}", f"/nograd_sin_{tag}", both)
        client.register_system_shared_memory(f"sout_{tag}", f"/nograd_sout_{tag}", 512)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status[f"sin_{tag}"]["byte_size"] == str(both)
        inputs = [triton_grpc.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(f"sin_{tag}", first_size)
        inputs[1].set_shared_memory(f"sin_{tag}", second_size, offset=first_size)
        output = triton_grpc.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(f"sout_{tag}", 512)
        client.infer("simple_string", inputs, outputs=[output])
        raw = shm.get_contents_as_numpy(region_out, np.uint8, [512]).tobytes()
        total = deserialize_bytes_tensor(raw[: 16 * 4 + sum(len(str(i + 1)) for i in range(16))])
        assert [int(v) for v in total] == [i + 1 for i in range(16)]
        small = triton_grpc.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory(f"sout_{tag}", 8)
        with pytest.raises(InferenceServerException, match="should be at least"):
            client.infer("simple_string", inputs, outputs=[small])
        client.unregister_system_shared_memory(f"sin_{tag}")
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
            client.infer("simple_string", inputs, outputs=[output])
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region_in)
        shm.destroy_shared_memory_region(region_out)
    assert client.get_cuda_shared_memory_status(as_json=True) == {}


def test_every_worker_sees_a_registration(tmp_path: Path, regions) -> None:
    tag, _, outputs = regions
    with simple_server(tmp_path, workers=2) as server:
        address = server.url.removeprefix("http://")
        first = triton_http.InferenceServerClient(address)
        first.register_system_shared_memory(f"in_{tag}", f"/nograd_in_{tag}", 2 * SIZE)
        first.register_system_shared_memory(f"out_{tag}", f"/nograd_out_{tag}", 2 * SIZE)
        # Each new client is a new connection: the two workers take them in turn.
        for _ in range(6):
            client = triton_http.InferenceServerClient(address)
            assert len(client.get_system_shared_memory_status()) == 2
            _http_infer(client, tag)
            client.close()
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(outputs, np.int32, [1, 16]), ROWS + ONES
        )
        first.unregister_system_shared_memory(f"in_{tag}")
        for _ in range(4):
            client = triton_http.InferenceServerClient(address)
            assert [r["name"] for r in client.get_system_shared_memory_status()] == [f"out_{tag}"]
            client.close()
