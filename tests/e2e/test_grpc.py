"""NVIDIA's own gRPC client (``tritonclient.grpc``) against a running nograd, unchanged: health,
metadata, configuration, repository, statistics, inference with raw and typed tensors (FP32 on
digits, BYTES on minilm) agreeing with HTTP, errors as gRPC status codes, and API keys."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import (
    ROOT,
    Server,
    digits_repository,
    free_port,
    metric_value,
    run_server,
    until_accepted,
)

pytestmark = pytest.mark.e2e

SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())["inputs"][0]
IMAGES = np.asarray(SAMPLE["data"], dtype=np.float32).reshape(SAMPLE["shape"])
KEY = "grpc-e2e-key-0123456789"


class GrpcServer:
    def __init__(self, server: Server, port: int) -> None:
        self.server = server
        self.address = f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(server: Server) -> GrpcServer:
    assert server.grpc_address is not None
    return GrpcServer(server, int(server.grpc_address.rsplit(":", 1)[1]))


@pytest.fixture(scope="module")
def client(served: GrpcServer) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(served.address)
    yield client
    client.close()


def _images(raw: bool) -> triton.InferInput:
    del raw  # tritonclient.grpc always sends raw contents
    tensor = triton.InferInput("image", list(IMAGES.shape), "FP32")
    tensor.set_data_from_numpy(IMAGES)
    return tensor


def test_health_metadata_and_configuration(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("minilm", "1")
    assert not client.is_model_ready("nope")
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "nograd"
    assert "model_configuration" in metadata["extensions"]
    digits = client.get_model_metadata("digits", as_json=True)
    assert digits["inputs"] == [
        {"name": "image", "datatype": "FP32", "shape": ["-1", "1", "8", "8"]}
    ]
    config = client.get_model_config("minilm", as_json=True)["config"]
    assert config["name"] == "minilm"
    text = config["input"][0]
    assert (text["data_type"], text["dims"], text["reshape"]) == ("TYPE_STRING", ["1"], {})
    assert config["parameters"]["batch_unit"] == {"string_value": "tokens"}
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["state"]) for m in index} == {("digits", "READY"), ("minilm", "READY")}


def test_infer_digits_matches_http(
    served: GrpcServer, client: triton.InferenceServerClient
) -> None:
    result = client.infer("digits", [_images(True)], request_id="g-1")
    assert result.get_response().id == "g-1"
    labels = result.as_numpy("label")
    logits = result.as_numpy("logits")
    assert labels is not None and logits is not None
    assert labels.shape == (len(IMAGES), 1)
    over_http = httpx.post(
        f"{served.server.url}/v2/models/digits/infer",
        json={"inputs": [SAMPLE]},
        timeout=30,
    ).json()
    by_name = {o["name"]: o for o in over_http["outputs"]}
    assert labels.reshape(-1).tolist() == by_name["label"]["data"]
    assert np.allclose(logits.reshape(-1), by_name["logits"]["data"], atol=1e-5)
    only = client.infer("digits", [_images(True)], outputs=[triton.InferRequestedOutput("label")])
    assert only.as_numpy("logits") is None and only.as_numpy("label") is not None


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_get_the_same_answer(
    client: triton.InferenceServerClient, algorithm: str
) -> None:
    """tritonclient's ``compression_algorithm`` (Triton's QA runs every client with each)."""
    plain = client.infer("digits", [_images(True)]).as_numpy("logits")
    packed = client.infer("digits", [_images(True)], compression_algorithm=algorithm)
    assert plain is not None and np.array_equal(packed.as_numpy("logits"), plain)


def test_infer_texts_on_minilm(client: triton.InferenceServerClient) -> None:
    texts = np.array([b"A man is eating food.", "Ünïcödé 🙂".encode(), b""], dtype=np.object_)
    tensor = triton.InferInput("text", [3], "BYTES")
    tensor.set_data_from_numpy(texts)
    result = client.infer("minilm", [tensor])
    embedding = result.as_numpy("embedding")
    assert embedding is not None and embedding.shape == (3, 384)
    assert np.allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-4)


def test_typed_contents_are_accepted(served: GrpcServer) -> None:
    """A request with the typed ``contents`` fields instead of raw bytes, as other clients send."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(served.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="digits")
        tensor = request.inputs.add(name="image", datatype="FP32", shape=list(IMAGES.shape))
        tensor.contents.fp32_contents.extend(IMAGES.reshape(-1).tolist())
        response = stub.ModelInfer(request, timeout=30)
    names = [o.name for o in response.outputs]
    raw = dict(zip(names, response.raw_output_contents, strict=True))
    labels = np.frombuffer(raw["label"], dtype="<i8")
    assert labels.size == len(IMAGES)


@pytest.mark.parametrize(
    ("model", "tensor", "code", "fragment"),
    [
        (
            "nope",
            ("image", "FP32", IMAGES),
            grpc.StatusCode.NOT_FOUND,
            "unknown model: 'nope' is not found",
        ),
        ("digits", ("pixels", "FP32", IMAGES), grpc.StatusCode.INVALID_ARGUMENT, "unexpected"),
        (
            "digits",
            ("image", "FP64", IMAGES.astype(np.float64)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "FP32",
        ),
    ],
)
def test_errors_are_status_codes_naming_the_problem(
    client: triton.InferenceServerClient,
    model: str,
    tensor: tuple[str, str, np.ndarray],
    code: grpc.StatusCode,
    fragment: str,
) -> None:
    name, datatype, array = tensor
    bad = triton.InferInput(name, list(array.shape), datatype)
    bad.set_data_from_numpy(array)
    with pytest.raises(InferenceServerException, match=fragment) as raised:
        client.infer(model, [bad])
    assert raised.value.status() == f"StatusCode.{code.name}"


def _hostile(model: str, name: str, datatype: str, shape: list[int]) -> Any:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def _send(served: GrpcServer, request: Any) -> grpc.RpcError:
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(served.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=60)
    return raised.value


@pytest.mark.parametrize(
    ("shape", "datatype", "contents", "fragment"),
    [
        ([1] * 70, "FP32", ("raw", b"\0" * 4), "70 dimensions is too large; the limit is 32"),
        ([0, 2**62, 2**62], "FP32", ("raw", b""), "the limit is 1099511627776 elements"),
        (
            [1],
            "UINT64",
            ("uint64_contents", [2**64 - 1]),
            "data-type is 'UINT64', but model .* expects 'FP32'",
        ),
    ],
    ids=["rank-70", "empty-with-huge-dims", "uint64-max"],
)
def test_hostile_headers_are_invalid_argument_not_internal(
    served: GrpcServer,
    shape: list[int],
    datatype: str,
    contents: tuple[str, Any],
    fragment: str,
) -> None:
    """Each answered INTERNAL (numpy or the int64 conversion crashing) before the header was
    checked; now a client error naming the input and the limit, and the server serves on."""
    request = _hostile("digits", "image", datatype, shape)
    field, value = contents
    if field == "raw":
        request.raw_input_contents.append(value)
    else:
        getattr(request.inputs[0].contents, field).extend(value)
    error = _send(served, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert re.search(f"input 'image'.*{fragment}", error.details() or ""), error.details()
    assert "Traceback" not in (error.details() or "")


def test_a_60_mib_bytes_tensor_over_the_row_limit_is_refused_at_once(
    served: GrpcServer, client: triton.InferenceServerClient
) -> None:
    """15.7M empty texts (60 MiB) to minilm took 19.6 s to reach this refusal, the worker's event
    loop blocked 19.3 s parsing them; the declared shape is refused before they are parsed. The
    bound is generous (the 60 MiB still cross the connection) for a loaded 2-core machine."""
    elements = 15 * 2**20
    request = _hostile("minilm", "text", "BYTES", [elements])
    request.raw_input_contents.append(bytes(4 * elements))
    url = served.server.url
    labels = {"model": "minilm", "reason": "too_large"}
    rejected = metric_value(url, "nograd_rejected_total", **labels)
    started = time.perf_counter()
    error = _send(served, request)
    took = time.perf_counter() - started
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "input 'text' has 15728640 rows" in (error.details() or "")
    assert "NOGRAD_MAX_REQUEST_ROWS" in (error.details() or "")
    assert took < 5.0, took
    assert metric_value(url, "nograd_rejected_total", **labels) == rejected + 1
    assert client.is_server_ready()


def test_control_calls_say_model_control_is_off(client: triton.InferenceServerClient) -> None:
    for control in (client.load_model, client.unload_model):
        with pytest.raises(
            InferenceServerException, match="model control is not enabled"
        ) as raised:
            control("digits")
        assert raised.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert client.is_model_ready("digits")


def test_statistics_health_service_and_metrics(
    served: GrpcServer, client: triton.InferenceServerClient
) -> None:
    stats = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    with grpc.insecure_channel(served.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    url = served.server.url
    assert (
        metric_value(url, "nograd_requests_total", model="digits", protocol="grpc", code="200") >= 2
    )
    assert (
        metric_value(url, "nograd_requests_total", model="_unknown", protocol="grpc", code="404")
        >= 1
    )


def test_an_api_key_is_required_in_the_metadata(tmp_path: Path) -> None:
    repo = digits_repository(tmp_path)
    port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(port),
        "NOGRAD_API_KEYS": KEY,
    }
    with run_server(tmp_path, env):
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert client.is_server_live()  # health stays open, as over HTTP
            with pytest.raises(InferenceServerException, match="missing API key") as raised:
                client.infer("digits", [_images(True)])
            assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
            with pytest.raises(InferenceServerException, match="invalid API key"):
                client.infer("digits", [_images(True)], headers={"authorization": "Bearer nope"})
            ok = client.infer("digits", [_images(True)], headers={"authorization": f"Bearer {KEY}"})
            assert ok.as_numpy("label") is not None
        finally:
            client.close()


def test_grpc_connections_are_spread_over_the_workers(tmp_path: Path) -> None:
    """The supervisor accepts gRPC connections as it does HTTP's and hands each to the least
    busy worker: eight channels, four on each worker, each served."""
    import psutil

    repo = digits_repository(tmp_path)
    port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(port),
        "NOGRAD_WORKERS": "2",
    }
    with run_server(tmp_path, env) as server:
        # grpc shares one connection among channels with the same target unless told not to.
        own = [("grpc.use_local_subchannel_pool", 1)]
        clients = [
            triton.InferenceServerClient(f"127.0.0.1:{port}", channel_args=own) for _ in range(8)
        ]
        try:
            for client in clients:
                assert client.infer("digits", [_images(True)]).as_numpy("label") is not None
            workers = [
                child
                for child in psutil.Process(server.process.pid).children()
                if "resource_tracker" not in " ".join(child.cmdline())
            ]
            held = [
                sum(
                    1
                    for c in worker.connections("tcp")
                    if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
                )
                for worker in workers
            ]
        finally:
            for client in clients:
                client.close()
        log = server.log()
    assert sorted(held) == [4, 4], (held, log)
    assert f"gRPC {port}" in log  # the supervisor listens on it, beside HTTP


def test_sigterm_drains_accepted_grpc_calls(tmp_path: Path) -> None:
    import asyncio
    import signal

    import tritonclient.grpc.aio as triton_aio

    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tests" / "fixtures" / "models" / "slow", repo / "slow")
    config = repo / "slow" / "config.toml"
    config.write_text(config.read_text().replace("max_queue_size = 4", "max_queue_size = 64"))
    port = free_port()
    env = {"NOGRAD_MODEL_REPOSITORY": str(repo), "NOGRAD_GRPC_PORT": str(port)}
    with run_server(tmp_path, env) as server:

        async def scenario() -> list[object]:
            client = triton_aio.InferenceServerClient(f"127.0.0.1:{port}")
            try:

                async def one(value: float) -> object:
                    row = triton_aio.InferInput("x", [1, 1], "FP32")
                    row.set_data_from_numpy(np.array([[value]], dtype=np.float32))
                    return (await client.infer("slow", [row])).as_numpy("y")

                calls = [asyncio.ensure_future(one(float(i))) for i in range(12)]
                await until_accepted(server.url, len(calls))  # most still queued: 0.6 s of work
                server.process.send_signal(signal.SIGTERM)
                return await asyncio.gather(*calls, return_exceptions=True)
            finally:
                await client.close()

        answers = asyncio.run(scenario())
        assert server.process.wait(30) == 0
    for index, answer in enumerate(answers):
        assert isinstance(answer, np.ndarray), answer
        assert answer.reshape(-1).tolist() == [index + 1.0]


def test_a_taken_grpc_port_stops_the_start_up_naming_the_setting(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Bound before the models load: the server exits at once, naming the setting, instead of
    loading for minutes or starting workers that cannot serve."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"NOGRAD_GRPC_PORT": str(port), "NOGRAD_WORKERS": "2"}
        with run_server(tmp_path_factory.mktemp("taken"), env, wait_ready=False) as server:
            assert server.process.wait(60) != 0
            assert "NOGRAD_GRPC_PORT" in server.log()
            assert "started (pid" not in server.log(), "a worker was started"


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_grpc_alone_with_http_turned_off(tmp_path: Path, workers: int) -> None:
    """``NOGRAD_PORT=0``: no HTTP port at all, gRPC serves, and a stop drains and exits."""
    repo = digits_repository(tmp_path)
    port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(port),
        "NOGRAD_WORKERS": str(workers),
        "NOGRAD_PORT": "0",
    }
    with run_server(tmp_path, env, wait_ready=False) as server:
        http_port = int(server.url.rsplit(":", 1)[1])  # the port an HTTP server would have had
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.is_server_ready():
                        break
                except InferenceServerException:
                    pass
                assert server.process.poll() is None, server.log()
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.2)
            assert client.infer("digits", [_images(True)]).as_numpy("label") is not None
        finally:
            client.close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", http_port), timeout=1).close()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0, server.log()
