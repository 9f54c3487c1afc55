"""KServe's own Python client (``kserve.inference_client.InferenceGRPCClient``, PyPI ``kserve``)
against a running nograd over gRPC, unchanged: server liveness and readiness, model readiness,
inference on digits with raw and with typed tensors, agreeing with HTTP.

The client has no metadata call, so model and server metadata go through the stub KServe
generates from its own V2 proto (``kserve.protocol.grpc``), on a channel of our own: nograd
serves Triton's proto, a superset of KServe's, and a KServe client must read it unchanged.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import numpy as np
import pytest
from kserve.inference_client import InferenceGRPCClient
from kserve.protocol.grpc import grpc_predict_v2_pb2 as kserve_pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput

from tests.e2e.serving import ROOT, Server, free_port, metric_value, run_server

pytestmark = pytest.mark.e2e

SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())["inputs"][0]
IMAGES = np.asarray(SAMPLE["data"], dtype=np.float32).reshape(SAMPLE["shape"])


class GrpcServer:
    def __init__(self, server: Server, port: int) -> None:
        self.server = server
        self.address = f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    port = free_port()
    with run_server(tmp_path_factory.mktemp("kserve"), {"NOGRAD_GRPC_PORT": str(port)}) as server:
        yield GrpcServer(server, port)


@pytest.fixture
async def client(served: GrpcServer) -> AsyncIterator[InferenceGRPCClient]:
    # A grpc.aio channel belongs to the event loop it was made on: one client per test.
    async with InferenceGRPCClient(served.address, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def over_http(served: GrpcServer) -> dict[str, list[float]]:
    """The sample's outputs from nograd's HTTP route, to compare the gRPC answers with."""
    answer = httpx.post(
        f"{served.server.url}/v2/models/digits/infer", json={"inputs": [SAMPLE]}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    return {o["name"]: o["data"] for o in answer.json()["outputs"]}


async def test_server_and_model_health(client: InferenceGRPCClient) -> None:
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready("digits")
    assert await client.is_model_ready("minilm")
    assert not await client.is_model_ready("nope")


async def test_model_and_server_metadata_through_kserves_proto(served: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = GRPCInferenceServiceStub(channel)
        model = await stub.ModelMetadata(kserve_pb.ModelMetadataRequest(name="digits"), timeout=30)
        server = await stub.ServerMetadata(kserve_pb.ServerMetadataRequest(), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ModelMetadata(kserve_pb.ModelMetadataRequest(name="nope"), timeout=30)
    assert model.name == "digits" and "1" in model.versions and model.platform
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("image", "FP32", [-1, 1, 8, 8])
    ]
    assert {(t.name, t.datatype, tuple(t.shape)) for t in model.outputs} == {
        ("logits", "FP32", (-1, 10)),
        ("probabilities", "FP32", (-1, 10)),
        ("label", "INT64", (-1, 1)),
    }
    assert server.name == "nograd" and server.version
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
async def test_infer_digits_matches_http(
    client: InferenceGRPCClient, over_http: dict[str, list[float]], raw: bool
) -> None:
    """Raw: ``set_data_from_numpy`` sends ``raw_input_contents``; typed: a list as ``data`` goes
    in ``contents.fp32_contents``. nograd answers raw either way, which KServe decodes."""
    if raw:
        image = InferInput("image", list(IMAGES.shape), "FP32")
        image.set_data_from_numpy(IMAGES)
    else:
        image = InferInput("image", list(IMAGES.shape), "FP32", data=IMAGES.ravel().tolist())
    request = InferRequest(model_name="digits", infer_inputs=[image], request_id=f"kserve-{raw}")
    response = await client.infer(request)
    assert response.id == f"kserve-{raw}" and response.model_name == "digits"
    outputs = {o.name: o.as_numpy() for o in response.outputs}
    assert set(outputs) == {"logits", "probabilities", "label"}
    assert outputs["label"].shape == (len(IMAGES), 1)
    assert outputs["label"].reshape(-1).tolist() == over_http["label"]
    assert np.allclose(outputs["logits"].reshape(-1), over_http["logits"], atol=1e-5)
    assert np.allclose(outputs["probabilities"].sum(axis=1), 1.0, atol=1e-5)


async def test_requested_outputs_and_metrics(
    served: GrpcServer, client: InferenceGRPCClient
) -> None:
    url = served.server.url
    before = metric_value(url, "nograd_requests_total", model="digits", protocol="grpc", code="200")
    image = InferInput("image", list(IMAGES.shape), "FP32")
    image.set_data_from_numpy(IMAGES)
    request = InferRequest(
        model_name="digits", infer_inputs=[image], request_outputs=[RequestedOutput("label")]
    )
    response = await client.infer(request)
    assert [o.name for o in response.outputs] == ["label"]
    after = metric_value(url, "nograd_requests_total", model="digits", protocol="grpc", code="200")
    assert after == before + 1
