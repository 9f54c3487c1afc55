"""Triton's protocol extensions with Triton's own clients, unchanged: the server name clients check
(``NOGRAD_SERVER_NAME``), HTTP compression of requests and answers, and classification, over HTTP
and gRPC on Triton's ``simple`` and a Triton classifier folder with a labels file."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from tests.e2e.serving import Server, free_port, run_server
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

ROWS = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)
OTHER = np.full((2, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("extensions")
    repo = root / "repo"
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_SERVER_NAME": "triton",
    }
    with run_server(root, env=env, ready_timeout_s=120) as running:
        yield running


@pytest.fixture(scope="module")
def http_client(server: Server) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server: Server) -> Iterator[triton_grpc.InferenceServerClient]:
    assert server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    yield client
    client.close()


def test_server_name_is_the_configured_one(
    http_client: triton_http.InferenceServerClient, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    assert http_client.get_server_metadata()["name"] == "triton"
    assert grpc_client.get_server_metadata().name == "triton"


@pytest.mark.parametrize("request_coding", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_coding", [None, "gzip", "deflate"])
def test_compressed_requests_and_answers(
    http_client: triton_http.InferenceServerClient,
    request_coding: str | None,
    response_coding: str | None,
) -> None:
    """Triton's QA runs every combination of ``request_compression_algorithm`` and
    ``response_compression_algorithm``; ``simple`` answers the sum and the difference."""
    inputs = []
    for name, array in (("INPUT0", ROWS), ("INPUT1", OTHER)):
        tensor = triton_http.InferInput(name, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array, binary_data=name == "INPUT0")
        inputs.append(tensor)
    outputs = [
        triton_http.InferRequestedOutput("OUTPUT0", binary_data=True),
        triton_http.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    result = http_client.infer(
        "simple",
        inputs,
        outputs=outputs,
        request_compression_algorithm=request_coding,
        response_compression_algorithm=response_coding,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), ROWS + OTHER)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), ROWS - OTHER)


def test_an_unknown_or_broken_coding_is_a_clear_400(server: Server) -> None:
    document = {
        "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}]
    }
    body = json.dumps(document).encode()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        url = "/v2/models/simple/infer"
        brotli = client.post(url, content=body, headers={"content-encoding": "br"})
        assert brotli.status_code == 400
        assert "Content-Encoding 'br' is not supported" in brotli.json()["error"]
        cut = client.post(
            url, content=gzip.compress(body)[:-20], headers={"content-encoding": "gzip"}
        )
        assert cut.status_code == 400
        assert "gzip stream is cut short" in cut.json()["error"]
        plain = client.post(url, content=body, headers={"accept-encoding": "gzip"})
        # An error is never compressed: clients read it as JSON.
        assert plain.status_code == 400 and "content-encoding" not in plain.headers
        document["inputs"].append({**document["inputs"][0], "name": "INPUT1"})
        for coding in ("gzip", "deflate"):
            answer = client.post(
                url, content=json.dumps(document), headers={"accept-encoding": coding}
            )
            assert answer.status_code == 200
            assert answer.headers["content-encoding"] == coding
            assert answer.json()["outputs"][0]["data"] == [0] * 16
