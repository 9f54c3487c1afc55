"""Triton's system shared-memory extension with tritonclient's own shared-memory utilities, over
HTTP and gRPC: inputs read from and outputs written into registered regions (fixed-size and
BYTES), the status and unregister calls, and bounds refused cleanly; with two workers a
registration made through one is used through every connection."""

from __future__ import annotations

import os
import threading
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


def _identity_request(region: str, byte_size: int, out_region: str, shape: list[int]) -> dict:
    """``simple_identity`` (BYTES in, the same BYTES out) with its input and output in regions."""
    return {
        "inputs": [
            {
                "name": "INPUT0",
                "datatype": "BYTES",
                "shape": shape,
                "parameters": {
                    "shared_memory_region": region,
                    "shared_memory_byte_size": byte_size,
                },
            }
        ],
        "outputs": [
            {
                "name": "OUTPUT0",
                "parameters": {
                    "shared_memory_region": out_region,
                    "shared_memory_byte_size": byte_size,
                },
            }
        ],
    }


def test_an_object_shrunk_while_requests_copy_it_is_a_400_and_the_server_lives(
    server: Server,
) -> None:
    """A client truncates its object while the server copies out of it: every answer is 200
    or 400 (never a dead worker: SIGBUS), a request after it succeeds, and one reading or
    writing a shrunk object is a 400 naming the region."""
    tag = uuid.uuid4().hex[:8]
    strings = np.array([[b"7" * 60_000] * 64], dtype=np.object_)
    serialized = serialize_byte_tensor(strings)
    size = serialized_byte_size(serialized)
    key_in, key_out = f"/nograd_shrink_in_{tag}", f"/nograd_shrink_out_{tag}"
    region_in = shm.create_shared_memory_region(f"shrink_in_{tag}", key_in, size)
    region_out = shm.create_shared_memory_region(f"shrink_out_{tag}", key_out, size)
    client = httpx.Client(base_url=server.url, timeout=60)
    request = _identity_request(f"shrink_in_{tag}", size, f"shrink_out_{tag}", [1, 64])
    fd = os.open(f"/dev/shm/{key_in.removeprefix('/')}", os.O_RDWR)
    stop = threading.Event()

    def shrink_and_grow() -> None:
        while not stop.is_set():
            os.ftruncate(fd, 4096)
            os.ftruncate(fd, size)

    try:
        shm.set_shared_memory_region(region_in, [serialized])
        for name, key in ((f"shrink_in_{tag}", key_in), (f"shrink_out_{tag}", key_out)):
            body = {"key": key, "offset": 0, "byte_size": size}
            registered = client.post(f"/v2/systemsharedmemory/region/{name}/register", json=body)
            assert registered.status_code == 200, registered.text
        truncating = threading.Thread(target=shrink_and_grow, daemon=True)
        truncating.start()
        try:
            statuses = [
                client.post("/v2/models/simple_identity/infer", json=request).status_code
                for _ in range(12)
            ]
        finally:
            stop.set()
            truncating.join(timeout=10)
        assert set(statuses) <= {200, 400}, statuses
        assert server.process.poll() is None, "the server died copying a shrunk object"
        os.ftruncate(fd, size)
        shm.set_shared_memory_region(region_in, [serialized])
        answer = client.post("/v2/models/simple_identity/infer", json=request)
        assert answer.status_code == 200, answer.text
        out = shm.get_contents_as_numpy(region_out, np.uint8, [size]).tobytes()
        assert list(deserialize_bytes_tensor(out)) == list(strings.ravel())
        # Shrunk, then read (the input) or written (the output): a 400 naming the region.
        os.ftruncate(fd, 4096)
        shrunk = client.post("/v2/models/simple_identity/infer", json=request)
        assert shrunk.status_code == 400
        assert f"shared memory region 'shrink_in_{tag}'" in shrunk.json()["error"]
        assert "shrank below the registered size" in shrunk.json()["error"]
        os.ftruncate(fd, size)
        shm.set_shared_memory_region(region_in, [serialized])
        out_fd = os.open(f"/dev/shm/{key_out.removeprefix('/')}", os.O_RDWR)
        try:
            os.ftruncate(out_fd, 4096)
        finally:
            os.close(out_fd)
        unwritten = client.post("/v2/models/simple_identity/infer", json=request)
        assert unwritten.status_code == 400
        assert f"shared memory region 'shrink_out_{tag}'" in unwritten.json()["error"]
        assert server.process.poll() is None
    finally:
        os.close(fd)
        for name in (f"shrink_in_{tag}", f"shrink_out_{tag}"):
            client.post(f"/v2/systemsharedmemory/region/{name}/unregister")
        client.close()
        shm.destroy_shared_memory_region(region_in)
        shm.destroy_shared_memory_region(region_out)


def _open_files(server: Server) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


def test_registrations_past_the_cap_are_refused_and_hold_one_descriptor_each(
    server: Server, regions
) -> None:
    """Registering past ``NOGRAD_MAX_SHARED_MEMORY_REGIONS`` (256 by default) is a clear 422
    over HTTP and RESOURCE_EXHAUSTED over gRPC; each region holds one descriptor, and health
    and new connections still answer."""
    tag, _, _ = regions
    key = f"/nograd_in_{tag}"
    opened_before = _open_files(server)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        try:
            for index in range(256):
                body = {"key": key, "offset": 0, "byte_size": SIZE}
                answer = client.post(
                    f"/v2/systemsharedmemory/region/cap_{index}_{tag}/register", json=body
                )
                assert answer.status_code == 200, answer.text
            assert _open_files(server) - opened_before <= 256 + 8
            past = client.post(
                f"/v2/systemsharedmemory/region/cap_past_{tag}/register",
                json={"key": key, "offset": 0, "byte_size": SIZE},
            )
            assert past.status_code == 422
            assert "at most 256 shared memory regions" in past.json()["error"]
            assert "NOGRAD_MAX_SHARED_MEMORY_REGIONS" in past.json()["error"]
            assert server.grpc_address is not None
            grpc_client = triton_grpc.InferenceServerClient(server.grpc_address)
            with pytest.raises(InferenceServerException, match="at most 256") as refused:
                grpc_client.register_system_shared_memory(f"cap_grpc_{tag}", key, SIZE)
            assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            grpc_client.close()
            # A fresh connection still gets its answer.
            assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
        finally:
            client.post("/v2/systemsharedmemory/unregister")
    assert _open_files(server) - opened_before <= 8


def test_bytes_in_shared_memory_past_the_decoded_limit_are_refused_before_the_copy(
    server: Server,
) -> None:
    """A BYTES input whose byte size passes ``NOGRAD_MAX_DECODED_BYTES`` (64 MiB by default) is
    refused with 422 / RESOURCE_EXHAUSTED before a byte of it is copied."""
    tag = uuid.uuid4().hex[:8]
    size = 64 * 1024 * 1024 + 4096
    key = f"/nograd_big_{tag}"
    path = f"/dev/shm/{key.removeprefix('/')}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: the test's object costs no memory
        with httpx.Client(base_url=server.url, timeout=30) as client:
            body = {"key": key, "offset": 0, "byte_size": size}
            registered = client.post(f"/v2/systemsharedmemory/region/big_{tag}/register", json=body)
            assert registered.status_code == 200, registered.text
            try:
                parameters = {"shared_memory_region": f"big_{tag}", "shared_memory_byte_size": size}
                request = {
                    "inputs": [
                        {
                            "name": "INPUT0",
                            "datatype": "BYTES",
                            "shape": [1, 1],
                            "parameters": parameters,
                        }
                    ]
                }
                answer = client.post("/v2/models/simple_identity/infer", json=request)
                assert answer.status_code == 422, answer.text
                assert "NOGRAD_MAX_DECODED_BYTES" in answer.json()["error"]
                assert server.grpc_address is not None
                grpc_client = triton_grpc.InferenceServerClient(server.grpc_address)
                placed = triton_grpc.InferInput("INPUT0", [1, 1], "BYTES")
                placed.set_shared_memory(f"big_{tag}", size)
                with pytest.raises(
                    InferenceServerException, match="NOGRAD_MAX_DECODED_BYTES"
                ) as refused:
                    grpc_client.infer("simple_identity", [placed])
                assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
                grpc_client.close()
            finally:
                client.post(f"/v2/systemsharedmemory/region/big_{tag}/unregister")
    finally:
        os.close(fd)
        os.unlink(path)
