"""Triton's CUDA shared-memory extension with tritonclient's own CUDA utilities, over HTTP and
gRPC: regions the test process allocates on GPU 0 and shares by IPC handle, opened by the server,
inputs read from them and outputs written into them; the status and unregister calls; bad handles
and bounds refused cleanly; with two workers a registration made through one is used through
every connection. Skipped without a GPU or without cuda-python."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.cuda import cuda_shared_memory_missing
from tests.e2e.serving import Server
from tests.e2e.shared_memory import assert_outside_offsets_refused, simple_server

MISSING = cuda_shared_memory_missing()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(MISSING), reason=MISSING)]
if not MISSING:
    import tritonclient.utils.cuda_shared_memory as cudashm

ROWS = np.arange(16, dtype=np.int32).reshape(1, 16)
ONES = np.ones((1, 16), dtype=np.int32)
SIZE = ROWS.nbytes
NAMES = ("in", "out0", "out1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with simple_server(tmp_path_factory.mktemp("cudashm")) as running:
        yield running


@pytest.fixture
def regions() -> Iterator[tuple[str, dict[str, Any]]]:
    """On GPU 0: an input region holding ROWS then ONES, and one region per output."""
    tag = uuid.uuid4().hex[:8]
    sizes = {"in": 2 * SIZE, "out0": SIZE, "out1": SIZE}
    handles = {n: cudashm.create_shared_memory_region(f"{n}_{tag}", s, 0) for n, s in sizes.items()}
    cudashm.set_shared_memory_region(handles["in"], [ROWS, ONES])
    try:
        yield tag, handles
    finally:
        for handle in handles.values():
            cudashm.destroy_shared_memory_region(handle)


def _register(client: Any, tag: str, handles: dict[str, Any]) -> None:
    sizes = {"in": 2 * SIZE, "out0": SIZE, "out1": SIZE}
    for name in NAMES:
        raw = cudashm.get_raw_handle(handles[name])
        client.register_cuda_shared_memory(f"{name}_{tag}", raw, 0, sizes[name])


def _infer(module: Any, client: Any, tag: str) -> None:
    inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory(f"in_{tag}", SIZE)
    inputs[1].set_shared_memory(f"in_{tag}", SIZE, offset=SIZE)
    outputs = [module.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory(f"out0_{tag}", SIZE)
    outputs[1].set_shared_memory(f"out1_{tag}", SIZE)
    client.infer("simple", inputs, outputs=outputs)


def _answers(handles: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    total = cudashm.get_contents_as_numpy(handles["out0"], np.int32, [1, 16])
    difference = cudashm.get_contents_as_numpy(handles["out1"], np.int32, [1, 16])
    return total, difference


def test_http_inputs_and_outputs_in_cuda_shared_memory(server: Server, regions) -> None:
    tag, handles = regions
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    _register(client, tag, handles)
    try:
        status = {r["name"]: r for r in client.get_cuda_shared_memory_status()}
        assert status[f"in_{tag}"] == {"name": f"in_{tag}", "device_id": 0, "byte_size": 2 * SIZE}
        assert client.get_system_shared_memory_status() == []
        _infer(triton_http, client, tag)
        total, difference = _answers(handles)
        np.testing.assert_array_equal(total, ROWS + ONES)
        np.testing.assert_array_equal(difference, ROWS - ONES)
        with pytest.raises(InferenceServerException, match="already in manager"):
            client.register_cuda_shared_memory(
                f"in_{tag}", cudashm.get_raw_handle(handles["in"]), 0, SIZE
            )
        with pytest.raises(InferenceServerException, match="registered as CUDA shared memory"):
            client.get_system_shared_memory_status(f"in_{tag}")
    finally:
        client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == []
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
        _infer(triton_http, client, tag)


def test_grpc_inputs_and_outputs_in_cuda_shared_memory(server: Server, regions) -> None:
    tag, handles = regions
    assert server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    _register(client, tag, handles)
    try:
        status = client.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert status[f"out0_{tag}"]["byte_size"] == str(SIZE)
        _infer(triton_grpc, client, tag)
        total, difference = _answers(handles)
        np.testing.assert_array_equal(total, ROWS + ONES)
        np.testing.assert_array_equal(difference, ROWS - ONES)
        client.unregister_cuda_shared_memory(f"in_{tag}")
        names = set(client.get_cuda_shared_memory_status(as_json=True)["regions"])
        assert names == {f"out0_{tag}", f"out1_{tag}"}
    finally:
        client.unregister_cuda_shared_memory()
        client.close()
    assert client.get_cuda_shared_memory_status(as_json=True) == {}


def test_bad_handles_and_bounds_are_refused(server: Server, regions) -> None:
    tag, handles = regions
    url = server.url
    raw = cudashm.get_raw_handle(handles["in"]).decode()
    route = f"{url}/v2/cudasharedmemory/region/in_{tag}/register"
    past_end = {"raw_handle": {"b64": raw}, "device_id": 0, "byte_size": 1 << 30}
    answer = httpx.post(route, json=past_end)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith(
        f"failed to register shared memory region 'in_{tag}': invalid args"
    )
    garbage = base64.b64encode(bytes(range(64))).decode()
    answer = httpx.post(
        route, json={"raw_handle": {"b64": garbage}, "device_id": 0, "byte_size": 8}
    )
    assert answer.status_code == 400
    assert "failed to register shared memory region: invalid args" in answer.json()["error"]
    assert "cudaIpcOpenMemHandle failed" in answer.json()["error"]
    short = {"raw_handle": {"b64": raw[:20]}, "device_id": 0, "byte_size": 8}
    answer = httpx.post(route, json=short)
    assert answer.status_code == 400
    assert "cudaIpcMemHandle_t" in answer.json()["error"]
    answer = httpx.post(route, json={"raw_handle": {"b64": raw}, "device_id": 0, "byte_size": SIZE})
    assert answer.status_code == 200, answer.text
    try:
        assert_outside_offsets_refused(url, f"in_{tag}", SIZE)
    finally:
        httpx.post(f"{url}/v2/cudasharedmemory/region/in_{tag}/unregister")
    assert httpx.get(f"{url}/v2/cudasharedmemory/status").json() == []


def test_every_worker_opens_a_cuda_registration(tmp_path: Path, regions) -> None:
    tag, handles = regions
    with simple_server(tmp_path, workers=2) as server:
        address = server.url.removeprefix("http://")
        first = triton_http.InferenceServerClient(address)
        _register(first, tag, handles)
        # Each new client is a new connection: the two workers take them in turn.
        for _ in range(6):
            client = triton_http.InferenceServerClient(address)
            assert len(client.get_cuda_shared_memory_status()) == 3
            _infer(triton_http, client, tag)
            client.close()
        total, _ = _answers(handles)
        np.testing.assert_array_equal(total, ROWS + ONES)
        first.unregister_cuda_shared_memory()
        for _ in range(4):
            client = triton_http.InferenceServerClient(address)
            assert client.get_cuda_shared_memory_status() == []
            client.close()
