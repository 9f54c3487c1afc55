"""Triton's protocol extensions with Triton's own clients, unchanged: the server name clients check
(``NOGRAD_SERVER_NAME``), HTTP compression of requests and answers, and classification, over HTTP
and gRPC on Triton's ``simple`` and a Triton classifier folder with a labels file."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

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
