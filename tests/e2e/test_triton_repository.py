"""A Triton model repository served as it is, beside a nograd folder: Triton's own ``simple``
folders (ONNX), TorchScript for Triton's PyTorch backend, ONNX with no config (auto-complete),
models without a batch dimension, version policies, and fields nograd refuses, named.

Answers are checked against what Triton's own clients check them against (``simple``:
OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1), over HTTP and gRPC with tritonclient.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import Server, free_port, metric_value, run_server
from tests.shipped_exports import seed_built_engines
from tests.triton_exchanges import (
    EXCHANGES,
    Exchange,
    differences,
    recorded_answers,
    send_grpc,
    send_http,
)
from tests.triton_models import SERVED, triton_repository

pytestmark = pytest.mark.e2e

ROWS = np.arange(5 * 16, dtype=np.int32).reshape(5, 16)
OTHER = np.full((5, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return triton_repository(tmp_path_factory.mktemp("triton"))


@pytest.fixture(scope="module")
def triton_server(triton_repo: Path) -> Iterator[Server]:
    repo = triton_repo
    root = repo.parent
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": ",".join([*SERVED, "fixed", "digits"]),
        # Unset (the harness sets eager): each model's own choice, sum_chosen's opt-in included.
        "NOGRAD_ENGINE": "",
        # A cache of its own: a choice remembered by an earlier run is not measured again. The
        # engines other tests of the run built from the same files (digits' ONNX model) are
        # opened, not built again: choosing one still checks and times it.
        "NOGRAD_ENGINE_CACHE": str(root / "engines"),
    }
    seed_built_engines(root / "engines")
    with run_server(root, env=env, ready_timeout_s=120) as server:
        yield server


@pytest.fixture(scope="module")
def http_client(triton_server: Server) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(triton_server.url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(triton_server: Server) -> Iterator[triton_grpc.InferenceServerClient]:
    assert triton_server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(triton_server.grpc_address)
    yield client
    client.close()


def _infer(client: object, module: object, model: str, tensors: dict[str, np.ndarray]) -> object:
    inputs = []
    for name, array in tensors.items():
        tensor = module.InferInput(name, list(array.shape), _datatype(array))  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.infer(model, inputs)  # type: ignore[attr-defined]


def _datatype(array: np.ndarray) -> str:
    types = {np.int32: "INT32", np.int8: "INT8", np.uint8: "UINT8", np.float32: "FP32"}
    return {**types, np.object_: "BYTES"}[array.dtype.type]


def test_every_model_ready_beside_nograds_own(
    http_client: triton_http.InferenceServerClient,
) -> None:
    for name in (*SERVED, "fixed", "digits"):
        assert http_client.is_model_ready(name), name
    index = {entry["name"]: entry for entry in http_client.get_model_repository_index()}
    assert index["simple"]["state"] == "READY"


def test_metadata_and_config_as_triton_reports_them(
    http_client: triton_http.InferenceServerClient,
) -> None:
    metadata = http_client.get_model_metadata("simple")
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["versions"] == ["2"]  # latest 1 of versions 1 and 2
    assert metadata["inputs"] == [
        {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]},
    ]
    config = http_client.get_model_config("simple")
    assert (config["platform"], config["backend"]) == ("onnxruntime_onnx", "onnxruntime")
    assert config["max_batch_size"] == 8
    assert [t["dims"] for t in config["input"]] == [[16], [16]]
    torchscript = http_client.get_model_config("cpu_instance")
    assert (torchscript["platform"], torchscript["backend"]) == ("pytorch_libtorch", "pytorch")
    assert torchscript["max_batch_size"] == 8
    assert torchscript["instance_group"][0]["kind"] == "KIND_CPU"
    # No batch dimension: the shapes as listed, and a max_batch_size of 0.
    assert http_client.get_model_metadata("scale_shift")["inputs"][0]["shape"] == [2, 3]
    assert http_client.get_model_config("scale_shift")["max_batch_size"] == 0


def test_auto_complete_of_onnx_without_config(
    http_client: triton_http.InferenceServerClient,
) -> None:
    auto = http_client.get_model_config("auto")
    # ONNX Runtime's backend adds dynamic batching; Triton's core prefers max_batch_size.
    assert auto["max_batch_size"] == 4
    assert auto["dynamic_batching"]["preferred_batch_size"] == [4]
    sized = http_client.get_model_config("auto_sized")
    assert sized["max_batch_size"] == 8
    assert sized["dynamic_batching"]["preferred_batch_size"] == [8]
    assert [t["name"] for t in sized["input"]] == ["INPUT0", "INPUT1"]
    # Dynamic batching a config sets itself gets the same preferred batch size, on any backend.
    queued = http_client.get_model_config("simple_string_queued")
    assert queued["dynamic_batching"]["preferred_batch_size"] == [8]
    # Without a batch dimension, or with tensors listed, no dynamic batching is added.
    assert "dynamic_batching" not in http_client.get_model_config("simple")
    assert [(t["name"], t["data_type"], t["dims"]) for t in auto["output"]] == [
        ("OUTPUT0", "TYPE_INT32", [16]),
        ("OUTPUT1", "TYPE_INT32", [16]),
    ]
    fixed = http_client.get_model_config("fixed")
    assert fixed["max_batch_size"] == 0
    assert fixed["input"][0]["dims"] == [2, 3]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = _infer(http_client, triton_http, "fixed", {"X": x})
    np.testing.assert_allclose(result.as_numpy("Y"), x + 1, atol=1e-5)  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    ("model", "names", "dtype"),
    [
        ("simple", ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"), np.int32),
        ("simple_int8", ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"), np.int8),
        ("cpu_instance", ("INPUT__0", "INPUT__1", "OUTPUT__0", "OUTPUT__1"), np.int32),
        ("auto", ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"), np.int32),
    ],
)
def test_sum_and_difference_exact(
    request: pytest.FixtureRequest,
    protocol: str,
    model: str,
    names: tuple[str, str, str, str],
    dtype: type,
) -> None:
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    a, b = ROWS.astype(dtype)[:4], OTHER.astype(dtype)[:4]
    result = _infer(client, module, model, {names[0]: a, names[1]: b})
    np.testing.assert_array_equal(result.as_numpy(names[2]), a + b)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(result.as_numpy(names[3]), a - b)  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_no_batch_dimension_torchscript(request: pytest.FixtureRequest, protocol: str) -> None:
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    result = _infer(client, module, "scale_shift", {"x": x})
    y = result.as_numpy("y")  # type: ignore[attr-defined]
    assert y.shape == (2, 3)
    np.testing.assert_allclose(y, 2 * x + 1, atol=1e-5)


def test_rows_of_one_request_run_as_one_batch(
    http_client: triton_http.InferenceServerClient,
) -> None:
    before = http_client.get_inference_statistics("simple_int8")["model_stats"][0]
    tensors = {"INPUT0": ROWS.astype(np.int8), "INPUT1": OTHER.astype(np.int8)}
    result = _infer(http_client, triton_http, "simple_int8", tensors)
    assert result.as_numpy("OUTPUT0").shape == (5, 16)  # type: ignore[attr-defined]
    after = http_client.get_inference_statistics("simple_int8")["model_stats"][0]
    assert int(after["inference_count"]) - int(before["inference_count"]) == 5
    assert int(after["execution_count"]) - int(before["execution_count"]) == 1


def _strings(values: np.ndarray) -> np.ndarray:
    return np.array([[str(v).encode() for v in row] for row in values], dtype=np.object_)


@pytest.mark.parametrize("protocol", ["http", "http-json", "grpc"])
def test_simple_string_answers_as_its_client_checks(
    request: pytest.FixtureRequest, protocol: str
) -> None:
    """Triton's simple_string clients: OUTPUT0 = str(int(a) + int(b)), OUTPUT1 the difference,
    BYTES elements given back as bytes (binary HTTP, JSON HTTP, gRPC)."""
    client = request.getfixturevalue(f"{protocol.removesuffix('-json')}_client")
    module = triton_http if protocol.startswith("http") else triton_grpc
    a, b = ROWS[:3], OTHER[:3]
    inputs = []
    for name, values in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, [3, 16], "BYTES")
        if protocol == "http-json":
            tensor.set_data_from_numpy(_strings(values), binary_data=False)
        else:
            tensor.set_data_from_numpy(_strings(values))
        inputs.append(tensor)
    if protocol == "http-json":
        outputs = [
            module.InferRequestedOutput(n, binary_data=False) for n in ("OUTPUT0", "OUTPUT1")
        ]
        result = client.infer("simple_string", inputs, outputs=outputs)
    else:
        result = client.infer("simple_string", inputs)
    # tritonclient gives JSON's strings as str, binary and gRPC elements as bytes.
    text = str if protocol == "http-json" else bytes
    for output, values in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        got = result.as_numpy(output)
        assert got.shape == (3, 16) and {type(v) for v in got.flat} == {text}
        assert [int(v) for v in got.flat] == values.reshape(-1).tolist()


def test_simple_string_over_json_gives_strings(triton_server: Server) -> None:
    url = f"{triton_server.url}/v2/models/simple_string/infer"
    tensors = [
        {"name": name, "datatype": "BYTES", "shape": [1, 16], "data": [str(v) for v in row[0]]}
        for name, row in (("INPUT0", ROWS), ("INPUT1", OTHER))
    ]
    answer = httpx.post(url, json={"inputs": tensors}, timeout=30)
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    assert outputs["OUTPUT0"]["datatype"] == "BYTES"
    assert outputs["OUTPUT0"]["data"] == [str(v) for v in ROWS[0] + OTHER[0]]
    assert outputs["OUTPUT1"]["data"] == [str(v) for v in ROWS[0] - OTHER[0]]
    bad = [{**tensors[0], "data": ["x"] * 16}, tensors[1]]
    refused = httpx.post(url, json={"inputs": bad, "id": "7"}, timeout=30)
    assert refused.status_code >= 400 and refused.status_code != 503  # the graph's own failure
    assert "stoll" in refused.text or "Cast" in refused.text


def test_simple_string_refuses_bytes_that_are_not_text(triton_server: Server) -> None:
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = triton_http.InferInput(name, [1, 16], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"\xff\xfe"] * 16], dtype=np.object_))
        tensors.append(tensor)
    body, length = triton_http.InferenceServerClient.generate_request_body(tensors)
    answer = httpx.post(
        f"{triton_server.url}/v2/models/simple_string/infer",
        content=body,
        headers={"Inference-Header-Content-Length": str(length)},
        timeout=30,
    )
    assert answer.status_code == 400
    assert "'INPUT0'" in answer.json()["error"] and "UTF-8" in answer.json()["error"]


def test_concurrent_string_requests_share_a_batch(
    triton_server: Server, http_client: triton_http.InferenceServerClient
) -> None:
    """Eight one-row requests sent at once run in fewer executions (one when they all arrive
    within the 200 ms queue delay), each answered with its own rows."""

    def send(index: int) -> np.ndarray:
        tensors = []
        for name, values in (("INPUT0", ROWS[:1] + index), ("INPUT1", OTHER[:1])):
            tensor = triton_http.InferInput(name, [1, 16], "BYTES")
            tensor.set_data_from_numpy(_strings(values))
            tensors.append(tensor)
        client = triton_http.InferenceServerClient(triton_server.url.removeprefix("http://"))
        try:
            return client.infer("simple_string_queued", tensors).as_numpy("OUTPUT0")  # type: ignore[no-any-return]
        finally:
            client.close()

    fewest = 8
    for _ in range(5):  # a loaded box may spread them over more than one delay
        before = http_client.get_inference_statistics("simple_string_queued")["model_stats"][0]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(send, range(8)))
        after = http_client.get_inference_statistics("simple_string_queued")["model_stats"][0]
        for index, answer in enumerate(answers):
            np.testing.assert_array_equal(answer, _strings(ROWS[:1] + index + OTHER[:1]))
        assert int(after["inference_count"]) - int(before["inference_count"]) == 8
        fewest = min(fewest, int(after["execution_count"]) - int(before["execution_count"]))
        if fewest == 1:
            break
    assert fewest < 8


def test_torchscript_opted_in_to_the_engine_choice_gets_one_checked_against_it(
    triton_server: Server, http_client: triton_http.InferenceServerClient
) -> None:
    """``nograd_engine`` in config.pbtxt: ONNX Runtime built from the TorchScript model, checked
    against it (reported in the log and the accuracy metrics), answering as Triton would;
    ``cpu_instance``, the same model without the parameter, stays on TorchScript alone."""
    log = triton_server.log()
    assert "model sum_chosen: engines measured at load" in log
    assert "model cpu_instance: engines measured at load" not in log
    from prometheus_client.parser import text_string_to_metric_families

    checked = {
        (sample.labels["model"], sample.labels["mode"], sample.value)
        for family in text_string_to_metric_families(httpx.get(f"{triton_server.url}/metrics").text)
        for sample in family.samples
        if sample.name == "nograd_model_accuracy_delta"
    }
    assert ("sum_chosen", "onnx", 0.0) in checked
    assert not {row for row in checked if row[0] == "cpu_instance"}
    config = http_client.get_model_config("sum_chosen")
    assert config["parameters"]["nograd_engine"]["string_value"] == "onnx"
    assert config["platform"] == "pytorch_libtorch"
    a, b = ROWS[:4], OTHER[:4]
    result = _infer(http_client, triton_http, "sum_chosen", {"INPUT__0": a, "INPUT__1": b})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a - b)  # type: ignore[attr-defined]


def test_version_policy_specific(http_client: triton_http.InferenceServerClient) -> None:
    assert http_client.get_model_metadata("simple_specific")["versions"] == ["1", "3"]
    assert http_client.is_model_ready("simple_specific", "3")
    assert not http_client.is_model_ready("simple_specific", "2")


def test_unsupported_fields_refused_by_name(triton_server: Server) -> None:
    for model, named in (("unsupported", "'sequence_batching.iterative_sequence'"),):
        response = httpx.post(f"{triton_server.url}/v2/repository/models/{model}/load", timeout=30)
        assert response.status_code == 400, response.text
        assert named in response.json()["error"]


def test_digits_still_served(triton_server: Server) -> None:
    document = httpx.get(f"{triton_server.url}/v2/models/digits/config").json()
    assert document["backend"] == "nograd"


def test_no_batch_dimension_refuses_a_batched_request(triton_server: Server) -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2, 3], "data": [0.0] * 6}]}
    response = httpx.post(f"{triton_server.url}/v2/models/scale_shift/infer", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "[request id: <id_unknown>] unexpected shape for input 'x' for model 'scale_shift'. "
        "Expected [2,3], got [1,2,3]. "
    )


def test_more_rows_than_max_batch_size_refused_as_triton_refuses_them(
    triton_server: Server, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    rows = np.zeros((9, 16), dtype=np.int32)  # simple's max_batch_size is 8
    tensors = [
        {"name": name, "datatype": "INT32", "shape": [9, 16], "data": rows.ravel().tolist()}
        for name in ("INPUT0", "INPUT1")
    ]
    response = httpx.post(f"{triton_server.url}/v2/models/simple/infer", json={"inputs": tensors})
    assert response.status_code == 400
    assert response.json()["error"] == (
        "[request id: <id_unknown>] inference request batch-size must be <= 8 for 'simple'"
    )
    body = {"id": "r-9", "inputs": tensors}
    response = httpx.post(f"{triton_server.url}/v2/models/simple/infer", json=body)
    assert response.json()["error"].startswith("[request id: r-9] inference request batch-size")
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = triton_grpc.InferInput(name, [9, 16], "INT32")
        tensor.set_data_from_numpy(rows)
        inputs.append(tensor)
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer("simple", inputs)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert raised.value.message() == (
        "[request id: <id_unknown>] inference request batch-size must be <= 8 for 'simple'"
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["add_sub", "pytorch"])
def test_python_backend_examples_answer_as_their_clients_check(
    request: pytest.FixtureRequest, protocol: str, model: str
) -> None:
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    a = np.array([0.5, -1.25, 3.0, 7.75], dtype=np.float32)
    b = np.array([2.0, 0.25, -3.5, 1.0], dtype=np.float32)
    result = _infer(client, module, model, {"INPUT0": a, "INPUT1": b})
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, atol=1e-5)  # type: ignore[attr-defined]
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, atol=1e-5)  # type: ignore[attr-defined]


def _auto_completed_http(recorded: dict[str, Any], name: str, max_batch_size: int) -> Any:
    """Triton's HTTP configuration of python_backend's auto_complete example (a ``1/model.py``
    alone), from its recorded one of ``guarded`` (a Python model with dynamic batching): the
    same fields, with the example's name, tensors and batch size, the default version policy,
    and Triton's NormalizeModelConfig's preferred batch size (the batch size) with no delay."""
    answer = json.loads(json.dumps(recorded))
    config = answer["body"]
    for kind, names in (("input", ("INPUT0", "INPUT1")), ("output", ("OUTPUT0", "OUTPUT1"))):
        config[kind] = [{**config[kind][0], "name": tensor, "dims": [4]} for tensor in names]
    config["name"] = config["instance_group"][0]["name"] = name
    config["version_policy"] = {"latest": {"num_versions": 1}}
    config["max_batch_size"] = max_batch_size
    if max_batch_size:
        config["dynamic_batching"]["preferred_batch_size"] = [max_batch_size]
        config["dynamic_batching"]["max_queue_delay_microseconds"] = 0
    else:
        del config["dynamic_batching"]
    return answer


def _auto_completed_grpc(recorded: dict[str, Any], name: str, max_batch_size: int) -> Any:
    """The same over gRPC (``MessageToDict``: camelCase, 64-bit numbers as text, defaults
    left out), from the recorded gRPC configuration of ``guarded``."""
    answer = json.loads(json.dumps(recorded))
    config = answer["body"]["config"]
    for kind, names in (("input", ("INPUT0", "INPUT1")), ("output", ("OUTPUT0", "OUTPUT1"))):
        config[kind] = [{**config[kind][0], "name": tensor, "dims": ["4"]} for tensor in names]
    config["name"] = config["instanceGroup"][0]["name"] = name
    config["versionPolicy"] = {"latest": {"numVersions": 1}}
    if max_batch_size:
        config["maxBatchSize"] = max_batch_size
        config["dynamicBatching"] = {"preferredBatchSize": [max_batch_size]}
    else:
        del config["maxBatchSize"], config["dynamicBatching"]
    return answer


@pytest.mark.parametrize(
    ("model", "max_batch_size"), [("batch_auto_complete", 4), ("nobatch_auto_complete", 0)]
)
def test_python_model_without_config_served_as_its_auto_complete_config_says(
    triton_server: Server,
    http_client: triton_http.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
    model: str,
    max_batch_size: int,
) -> None:
    """python_backend's auto_complete example deployed as its README deploys it (a
    ``1/model.py`` alone): its configuration and metadata as Triton answers them, and its
    answers as the example's client checks them, over HTTP and gRPC."""
    recorded = recorded_answers()
    with httpx.Client(timeout=30) as client:
        got = send_http(
            client, triton_server.url, Exchange("", "http", "GET", f"/v2/models/{model}/config")
        )
    expected = _auto_completed_http(recorded["http-config-guarded"], model, max_batch_size)
    assert differences(expected, got) == []
    got = send_grpc(grpc_client, Exchange("", "grpc", "config", model=model))
    expected = _auto_completed_grpc(recorded["grpc-config-guarded"], model, max_batch_size)
    assert differences(expected, got) == []
    batch = [-1] if max_batch_size else []
    metadata = http_client.get_model_metadata(model)
    assert (metadata["platform"], metadata["versions"]) == ("python", ["1"])
    for kind, names in (("inputs", ("INPUT0", "INPUT1")), ("outputs", ("OUTPUT0", "OUTPUT1"))):
        assert metadata[kind] == [
            {"name": n, "datatype": "FP32", "shape": [*batch, 4]} for n in names
        ]
    a = np.array([0.5, -1.25, 3.0, 7.75], dtype=np.float32)
    b = np.array([2.0, 0.25, -3.5, 1.0], dtype=np.float32)
    if max_batch_size:
        a, b = np.stack([a, 2 * a]), np.stack([b, -b])
    for client, module in ((http_client, triton_http), (grpc_client, triton_grpc)):
        result = _infer(client, module, model, {"INPUT0": a, "INPUT1": b})
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, atol=1e-5)  # type: ignore[attr-defined]
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, atol=1e-5)  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_ensemble_over_a_python_model_without_config(
    request: pytest.FixtureRequest, protocol: str
) -> None:
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.full((3, 4), 0.5, dtype=np.float32)
    twice = _infer(client, module, "auto_complete_twice", {"A": a, "B": b})
    np.testing.assert_allclose(twice.as_numpy("TWICE_A"), 2 * a, atol=1e-5)  # type: ignore[attr-defined]
    np.testing.assert_allclose(twice.as_numpy("TWICE_B"), 2 * b, atol=1e-5)  # type: ignore[attr-defined]


def test_python_backend_metadata(http_client: triton_http.InferenceServerClient) -> None:
    metadata = http_client.get_model_metadata("add_sub")
    assert metadata["platform"] == "python"  # Triton names the backend when no platform is set
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [4]}
    config = http_client.get_model_config("add_sub")
    assert (config["backend"], config["max_batch_size"]) == ("python", 0)
    assert http_client.get_model_metadata("guarded")["versions"] == ["1", "2"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_python_backend_strings(request: pytest.FixtureRequest, protocol: str) -> None:
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    text = np.array([[b"triton", b"", "\u00e9t\u00e9".encode()]], dtype=np.object_)
    result = _infer(client, module, "simple_identity", {"INPUT0": text})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), text)  # type: ignore[attr-defined]


def test_python_backend_error_responses(
    triton_server: Server, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    url = f"{triton_server.url}/v2/models/guarded/infer"

    def body(values: list[float]) -> dict[str, object]:
        return {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": values}]}

    refused = httpx.post(url, json=body([-1.0, 0.0]))
    assert (refused.status_code, refused.json()["error"]) == (400, "X must not be negative")
    failed = httpx.post(url, json=body([5000.0, 0.0]))
    assert (failed.status_code, failed.json()["error"]) == (500, "too large")
    tensor = triton_grpc.InferInput("X", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[-1.0, 0.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer("guarded", [tensor])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert raised.value.message() == "X must not be negative"
    # The default code, INTERNAL: Triton's gRPC front passes the model's message as HTTP does.
    tensor.set_data_from_numpy(np.array([[5000.0, 0.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer("guarded", [tensor])
    assert raised.value.status() == "StatusCode.INTERNAL"
    assert raised.value.message() == "too large"


def test_python_backend_versions_are_separate_modules(
    http_client: triton_http.InferenceServerClient,
) -> None:
    x = np.array([[3.0, 0.0]], dtype=np.float32)
    for version, scale in (("1", 1), ("2", 10)):
        tensor = triton_http.InferInput("X", [1, 2], "FP32")
        tensor.set_data_from_numpy(x)
        result = http_client.infer("guarded", [tensor], model_version=version)
        assert result.as_numpy("Y")[0, 0] == 3.0 * scale


def test_python_backend_takes_queued_requests_in_one_execute(triton_server: Server) -> None:
    url = f"{triton_server.url}/v2/models/guarded/versions/1/infer"

    def send(index: int) -> httpx.Response:
        value = -1.0 if index == 0 else float(index)
        data = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [value, 0]}]}
        return httpx.post(url, json=data, timeout=30)

    most = 0
    for _ in range(10):  # they queue behind a 20 ms execute; a loaded box may miss it
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(send, range(8)))
        assert responses[0].status_code == 400  # its bad input fails it alone
        for index, response in enumerate(responses[1:], start=1):
            assert response.status_code == 200, response.text
            output = response.json()["outputs"][0]["data"]
            assert output[0] == float(index)
            most = max(most, int(output[1]))
        if most > 1:
            break
    assert 1 < most <= 8


# ------------------------------------------------------------------------------------ ensembles
def test_ensembles_ready_reported_as_triton_reports_them(
    http_client: triton_http.InferenceServerClient,
) -> None:
    for name in ("ensemble_python_resnet50", "chain", "guarded_twice", "simple_ensemble"):
        assert http_client.is_model_ready(name), name
    metadata = http_client.get_model_metadata("ensemble_python_resnet50")
    assert metadata["platform"] == "ensemble"
    assert metadata["inputs"] == [{"name": "INPUT", "datatype": "UINT8", "shape": [-1, -1]}]
    config = http_client.get_model_config("ensemble_python_resnet50")
    assert (config["platform"], config["backend"], config["max_batch_size"]) == (
        "ensemble",
        "",
        256,
    )
    assert not config.get("instance_group")
    steps = config["ensemble_scheduling"]["step"]
    assert [(s["model_name"], s["model_version"]) for s in steps] == [
        ("preprocess", -1),
        ("resnet50_trt", -1),
    ]
    assert steps[1]["input_map"] == {"input": "preprocessed_image"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_answers_as_its_steps_composed(
    request: pytest.FixtureRequest, protocol: str
) -> None:
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    raw = np.random.default_rng(0).integers(0, 256, (3, 50), dtype=np.uint8)
    scores = _infer(client, module, "ensemble_python_resnet50", {"INPUT": raw})
    image = _infer(client, module, "preprocess", {"INPUT_0": raw})
    image_array = image.as_numpy("OUTPUT_0")  # type: ignore[attr-defined]
    direct = _infer(client, module, "resnet50_trt", {"input": image_array})
    assert scores.as_numpy("OUTPUT").shape == (3, 1000)  # type: ignore[attr-defined]
    np.testing.assert_allclose(
        scores.as_numpy("OUTPUT"),  # type: ignore[attr-defined]
        direct.as_numpy("output"),  # type: ignore[attr-defined]
        atol=1e-5,
    )
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([10, 20, 30, 40], dtype=np.float32)
    chain = _infer(client, module, "chain", {"A": a, "B": b})
    expected = {"SUM": a + b, "TWICE_B": 2 * b, "THRICE_A_PLUS_B": 3 * a + b, "B_MINUS_A": b - a}
    for name, value in expected.items():
        np.testing.assert_allclose(chain.as_numpy(name), value, atol=1e-5)  # type: ignore[attr-defined]
    x0, x1 = ROWS[:2], OTHER[:2]
    simple = _infer(client, module, "simple_ensemble", {"IN0": x0, "IN1": x1})
    np.testing.assert_array_equal(simple.as_numpy("OUT"), x0 + x1)  # type: ignore[attr-defined]


def test_ensemble_step_error_fails_the_request_with_its_message(
    triton_server: Server, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    url = f"{triton_server.url}/v2/models/guarded_twice/infer"
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [-1.0, 0.0]}]}
    refused = httpx.post(url, json=body)
    assert refused.status_code == 400
    assert refused.json()["error"] == "in ensemble 'guarded_twice', X must not be negative"
    tensor = triton_grpc.InferInput("X", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[5000.0, 0.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer("guarded_twice", [tensor])
    assert raised.value.status() == "StatusCode.INTERNAL"


def test_concurrent_ensemble_requests_batch_in_the_step_models(
    http_client: triton_http.InferenceServerClient, triton_server: Server
) -> None:
    url = f"{triton_server.url}/v2/models/guarded_twice/infer"

    def counts(name: str) -> tuple[int, int]:
        found = http_client.get_inference_statistics(name)["model_stats"][0]
        return int(found["inference_count"]), int(found["execution_count"])

    def send(index: int) -> httpx.Response:
        data = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [index, 0]}]}
        return httpx.post(url, json=data, timeout=30)

    executions = 16
    for _ in range(10):  # they queue behind a 20 ms execute; a loaded box may miss it
        before, ensemble_before = counts("guarded"), counts("guarded_twice")
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(send, range(8)))
        for index, response in enumerate(responses):
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"][0] == 10.0 * index
        after, ensemble_after = counts("guarded"), counts("guarded_twice")
        # Both steps run on guarded (versions 1 and 2, whose statistics add up under its name).
        assert after[0] - before[0] == 16
        assert ensemble_after[0] - ensemble_before[0] == 8
        assert ensemble_after[1] - ensemble_before[1] == 8
        executions = after[1] - before[1]
        if executions < 16:
            break
    assert executions < 16


def test_ensemble_load_errors_name_the_problem(
    http_client: triton_http.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as missing:
        http_client.load_model("ensemble_missing")
    assert (
        "ensemble ensemble_missing contains models that are not available or ambiguous: nowhere"
        in missing.value.message()
    )
    with pytest.raises(InferenceServerException) as bad_input:
        http_client.load_model("ensemble_bad_input")
    assert (
        "in ensemble ensemble_bad_input, ensemble tensor IN0 is mapping to non-existing input "
        "NOPE in model simple" in bad_input.value.message()
    )


def test_unloading_a_step_model_makes_the_ensemble_unready(
    http_client: triton_http.InferenceServerClient, triton_server: Server
) -> None:
    http_client.unload_model("simple_step")
    try:
        assert not http_client.is_model_ready("simple_ensemble")
        assert _ready_metric(triton_server, "simple_ensemble") == 0
        index = {e["name"]: e for e in http_client.get_model_repository_index()}
        assert index["simple_ensemble"]["state"] == "UNAVAILABLE"
        assert "simple_step" in index["simple_ensemble"]["reason"]
        with pytest.raises(InferenceServerException) as raised:
            _infer(http_client, triton_http, "simple_ensemble", {"IN0": ROWS, "IN1": OTHER})
        assert "simple_step" in raised.value.message()
    finally:
        http_client.load_model("simple_step")
    assert http_client.is_model_ready("simple_ensemble")
    assert _ready_metric(triton_server, "simple_ensemble") == 1


def _ready_metric(server: Server, name: str) -> float:
    return metric_value(server.url, "nograd_model_ready", model=name)


def _index_state(client: triton_http.InferenceServerClient, name: str) -> dict[str, str]:
    found: dict[str, str] = {e["name"]: e for e in client.get_model_repository_index()}[name]
    return found


def test_loading_an_ensemble_loads_its_step_models_as_triton_does(
    http_client: triton_http.InferenceServerClient, triton_server: Server, triton_repo: Path
) -> None:
    assert not http_client.is_model_ready("lazy_step")
    http_client.load_model("lazy_ensemble")
    assert http_client.is_model_ready("lazy_step")
    assert http_client.is_model_ready("lazy_ensemble")
    assert _ready_metric(triton_server, "lazy_ensemble") == 1
    answer = _infer(http_client, triton_http, "lazy_ensemble", {"IN0": ROWS, "IN1": OTHER})
    np.testing.assert_array_equal(answer.as_numpy("OUT"), ROWS + OTHER)  # type: ignore[attr-defined]
    # By default an unload takes the named model alone; with unload_dependents, the step
    # models the ensemble brought with it too.
    http_client.unload_model("lazy_ensemble")
    assert http_client.is_model_ready("lazy_step")
    http_client.load_model("lazy_ensemble")
    http_client.unload_model("lazy_ensemble", unload_dependents=True)
    assert not http_client.is_model_ready("lazy_step")
    assert _index_state(http_client, "lazy_step").get("state") != "READY"


def test_a_step_model_reloaded_with_another_config_is_checked_against_its_ensembles(
    http_client: triton_http.InferenceServerClient, triton_server: Server, triton_repo: Path
) -> None:
    config = triton_repo / "lazy_step" / "config.pbtxt"
    original = config.read_text()
    http_client.load_model("lazy_ensemble")
    try:
        config.write_text(original.replace("max_batch_size: 8", "max_batch_size: 4"))
        http_client.load_model("lazy_step")
        assert not http_client.is_model_ready("lazy_ensemble")
        assert _ready_metric(triton_server, "lazy_ensemble") == 0
        assert _index_state(http_client, "lazy_ensemble")["reason"] == (
            "failed to load: ensemble lazy_ensemble allows maximum batch size 8, but it "
            "contains model lazy_step which only allows maximum batch size to be 4"
        )
        config.write_text(original)
        http_client.load_model("lazy_step")
        assert http_client.is_model_ready("lazy_ensemble")
        assert _ready_metric(triton_server, "lazy_ensemble") == 1
    finally:
        config.write_text(original)
        http_client.unload_model("lazy_ensemble")
        http_client.unload_model("lazy_step")


# ------------------------------------------------------------------------------- model_warmup
def test_model_warmup_runs_at_load_as_triton_runs_it(
    http_client: triton_http.InferenceServerClient,
) -> None:
    # warmed's first execute took the warmup sample's two requests (the file's 1.5 and 2.5).
    answer = _infer(http_client, triton_http, "warmed", {"X": np.ones((1, 2), np.float32)})
    np.testing.assert_array_equal(answer.as_numpy("Y")[0], [4.0, 4.0])  # type: ignore[attr-defined]
    with pytest.raises(InferenceServerException) as failing:
        http_client.load_model("warm_failing")
    assert "failed to run warmup sample 'zero sample': An Error Occurred" in (
        failing.value.message()
    )
    assert not http_client.is_model_ready("warm_failing")
    with pytest.raises(InferenceServerException) as short:
        http_client.load_model("simple_warm_short")
    assert (
        "warmup setting expects 64 bytes, but the data provided from in only has 32 bytes"
        in short.value.message()
    )


# ----------------------------------------------------------------------------- optional inputs
def test_python_model_optional_input_may_be_left_out(
    http_client: triton_http.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
    triton_server: Server,
) -> None:
    a = np.array([[1.0, 0.0]], np.float32)
    b = np.array([[10.0, 0.0]], np.float32)
    for client, module in ((http_client, triton_http), (grpc_client, triton_grpc)):
        alone = _infer(client, module, "optional_sum", {"A": a})
        assert alone.as_numpy("Y")[0, 0] == 1.0  # type: ignore[attr-defined]
        both = _infer(client, module, "optional_sum", {"A": a, "B": b})
        assert both.as_numpy("Y")[0, 0] == 11.0  # type: ignore[attr-defined]
    url = f"{triton_server.url}/v2/models/optional_sum/infer"
    body = {"inputs": [{"name": "B", "datatype": "FP32", "shape": [1, 2], "data": [1, 0]}]}
    refused = httpx.post(url, json=body)
    assert refused.status_code == 400
    assert "missing required input(s) ['A']" in refused.json()["error"]


def test_requests_with_different_optional_inputs_never_share_a_batch(
    triton_server: Server,
) -> None:
    url = f"{triton_server.url}/v2/models/optional_sum/infer"

    def send(index: int) -> httpx.Response:
        tensors = [{"name": "A", "datatype": "FP32", "shape": [1, 2], "data": [index, 0]}]
        if index % 2:
            tensors.append({"name": "B", "datatype": "FP32", "shape": [1, 2], "data": [100, 0]})
        return httpx.post(url, json={"inputs": tensors}, timeout=30)

    most = 0
    for _ in range(3):  # the requests queue behind a 50 ms execute; a loaded box may miss it
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(send, range(8)))
        for index, response in enumerate(responses):
            assert response.status_code == 200, response.text
            total, took = response.json()["outputs"][0]["data"][:2]
            assert total == index + (100 if index % 2 else 0)
            assert took > 0, "requests with and without B shared an execute"
            most = max(most, int(took))
        if most > 1:
            break
    assert most > 1  # they did batch, each set of inputs with its own


@pytest.mark.slow  # two workers of its own: ~22 s on the 2-core box
def test_every_worker_loads_an_ensemble_with_its_step_models(
    triton_repo: Path, tmp_path: Path
) -> None:
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(triton_repo),
        "NOGRAD_WORKERS": "2",
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "digits",
    }
    with run_server(tmp_path, env=env, ready_timeout_s=120) as server:
        assert (
            httpx.post(f"{server.url}/v2/repository/models/lazy_ensemble/load").status_code == 200
        )
        body = {
            "inputs": [
                {"name": name, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                for name in ("IN0", "IN1")
            ]
        }
        statuses = set()
        for _ in range(12):  # a connection each, so both workers answer
            with httpx.Client(base_url=server.url, timeout=30) as http:
                answer = http.post("/v2/models/lazy_ensemble/infer", json=body)
                statuses.add((answer.status_code, answer.text if answer.status_code != 200 else ""))
                assert answer.status_code != 200 or answer.json()["outputs"][0]["data"] == [2] * 16
        assert statuses == {(200, "")}


def test_answers_equal_tritons(
    triton_server: Server, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    """Every call of ``tests/triton_exchanges.py`` answered as Triton 2.51 answered it
    (``scripts/record_triton_answers.py``): metadata, configuration, answers and errors, over
    HTTP and gRPC, floats within 1e-5, one call at a time."""
    recorded = recorded_answers()
    assert sorted(recorded) == sorted(exchange.name for exchange in EXCHANGES)
    with httpx.Client(timeout=60) as client:
        answers = {
            e.name: send_http(client, triton_server.url, e)
            if e.api == "http"
            else send_grpc(grpc_client, e)
            for e in EXCHANGES
        }
    found = {name: differences(recorded[name], answers[name]) for name in recorded}
    failed = {name: diff for name, diff in found.items() if diff}
    assert not failed, json.dumps(failed, indent=1)


def test_model_stream_infer_answers_each_request_and_errors_in_stream(
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    """Triton's streaming call: many requests on one stream, each answered as it is ready (by
    its id), a refused one answered with its error in the stream, which goes on."""
    answers: Queue[tuple[object, object]] = Queue()
    grpc_client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for index in range(4):
            rows = ROWS[:1] + index
            tensors = []
            for name, value in (("INPUT0", rows), ("INPUT1", OTHER[:1])):
                tensor = triton_grpc.InferInput(name, list(value.shape), "INT32")
                tensor.set_data_from_numpy(value)
                tensors.append(tensor)
            grpc_client.async_stream_infer("simple", tensors, request_id=f"r{index}")
            if index == 1:
                wrong = triton_grpc.InferInput("INPUT0", [1, 3], "INT32")
                wrong.set_data_from_numpy(np.zeros((1, 3), np.int32))
                grpc_client.async_stream_infer("simple", [wrong, tensors[1]], request_id="bad")
        got = [answers.get(timeout=30) for _ in range(5)]
    finally:
        grpc_client.stop_stream()
    errors = [str(error) for result, error in got if error is not None]
    assert len(errors) == 1
    assert "unexpected shape for input 'INPUT0' for model 'simple'" in errors[0]
    sums = {}
    for result, error in got:
        if error is None:
            response = result.get_response()  # type: ignore[attr-defined]
            sums[response.id] = result.as_numpy("OUTPUT0")  # type: ignore[attr-defined]
    assert sorted(sums) == ["r0", "r1", "r2", "r3"]
    for index in range(4):
        np.testing.assert_array_equal(sums[f"r{index}"], ROWS[:1] + index + OTHER[:1])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sequence_request_to_a_model_without_sequences_is_refused(
    request: pytest.FixtureRequest, protocol: str
) -> None:
    """``sequence_id`` and its flags are never silently dropped: no model here keeps a
    sequence's state, so such a request is refused, naming what it asked for."""
    client = request.getfixturevalue(f"{protocol}_client")
    module = triton_http if protocol == "http" else triton_grpc
    tensors = []
    for name, value in (("INPUT0", ROWS[:1]), ("INPUT1", OTHER[:1])):
        tensor = module.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("simple", tensors, sequence_id=5, sequence_start=True)
    assert "model 'simple' is not a sequence model" in str(refused.value)
    assert "sequence_id, sequence_start cannot be honoured" in str(refused.value)
    client.infer("simple", tensors)  # the same without them is served
