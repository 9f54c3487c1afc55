"""Triton's protocol extensions with Triton's own clients, unchanged: the server name clients check
(``NOGRAD_SERVER_NAME``), HTTP compression of requests and answers, and classification over HTTP
and gRPC: on ``simple_labelled`` (Triton's ``simple`` with a ``label_filename`` on ``OUTPUT0``) and
on nograd's ``digits`` with labels in its ``config.toml``."""

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
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import ROOT, Server, free_port, run_server
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

LABELLED = 14
"""Lines of simple_labelled's labels file: indices 14 and 15 have no label."""
DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
ROWS = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)
OTHER = np.full((2, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("extensions")
    repo = root / "repo"
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    labelled = repo / "simple_labelled"
    shutil.copytree(FIXTURES / "simple" / "1", labelled / "1")
    config = (FIXTURES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"labelled"')
    first_output = config.index('name: "OUTPUT0"')
    config = config[:first_output] + 'label_filename: "labels.txt"\n    ' + config[first_output:]
    (labelled / "config.pbtxt").write_text(config.replace('"labelled"', '"simple_labelled"'))
    (labelled / "labels.txt").write_text("".join(f"class {i}\n" for i in range(LABELLED)))
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    toml = (
        (repo / "digits" / "config.toml").read_text().replace('engine = "auto"', 'engine = "eager"')
    )
    toml = toml.replace(
        'name = "probabilities"', f'name = "probabilities"\nlabels = {json.dumps(DIGIT_NAMES)}'
    )
    (repo / "digits" / "config.toml").write_text(toml)
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


def _simple_inputs(module: object) -> list[object]:
    inputs = []
    for name, array in (("INPUT0", ROWS), ("INPUT1", OTHER)):
        tensor = module.InferInput(name, list(array.shape), "INT32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _expected_classes(row: np.ndarray, count: int) -> list[bytes]:
    best = sorted(range(row.size), key=lambda index: -row[index])[:count]
    return [f"{row[i]}:{i}{f':class {i}' if i < LABELLED else ''}".encode() for i in best]


@pytest.mark.parametrize("binary", [True, False])
def test_classification_over_http_with_a_triton_labels_file(
    http_client: triton_http.InferenceServerClient, binary: bool
) -> None:
    outputs = [
        triton_http.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=3),
        triton_http.InferRequestedOutput("OUTPUT1", binary_data=binary),
    ]
    result = http_client.infer("simple_labelled", _simple_inputs(triton_http), outputs=outputs)
    classes = result.as_numpy("OUTPUT0")
    assert classes is not None and classes.shape == (2, 3)
    total = ROWS + OTHER
    for row in range(2):
        # JSON answers BYTES as text, which tritonclient leaves as str.
        got = [value if isinstance(value, bytes) else value.encode() for value in classes[row]]
        assert got == _expected_classes(total[row], 3)
    assert _expected_classes(total[0], 3)[0] == b"18:15"  # past the labels file: no label
    assert _expected_classes(total[0], 3)[2] == b"16:13:class 13"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), ROWS - OTHER)


def test_classification_over_grpc_is_never_ignored(
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    outputs = [triton_grpc.InferRequestedOutput("OUTPUT0", class_count=2)]
    result = grpc_client.infer("simple_labelled", _simple_inputs(triton_grpc), outputs=outputs)
    classes = result.as_numpy("OUTPUT0")
    assert classes is not None and classes.shape == (2, 2)
    total = ROWS + OTHER
    assert [row.tolist() for row in classes] == [_expected_classes(r, 2) for r in total]


def test_a_nograd_model_classifies_with_its_own_labels(
    http_client: triton_http.InferenceServerClient, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    images = np.asarray(
        json.loads((ROOT / "models/digits/sample.json").read_text())["inputs"][0]["data"],
        dtype=np.float32,
    ).reshape(-1, 1, 8, 8)[:2]
    answers = []
    for module, client in ((triton_http, http_client), (triton_grpc, grpc_client)):
        tensor = module.InferInput("image", list(images.shape), "FP32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(images)
        plain = client.infer("digits", [tensor]).as_numpy("probabilities")  # type: ignore[attr-defined]
        asked = [module.InferRequestedOutput("probabilities", class_count=1)]  # type: ignore[attr-defined]
        classes = client.infer("digits", [tensor], outputs=asked).as_numpy("probabilities")  # type: ignore[attr-defined]
        best = plain.argmax(axis=1)
        assert classes.shape == (len(images), 1)
        for row, index in enumerate(best):
            score, place, name = classes[row][0].decode().split(":")
            assert (int(place), name) == (index, DIGIT_NAMES[index])
            assert score == f"{plain[row][index]:f}"
        answers.append(classes.tolist())
    assert answers[0] == answers[1]


def test_classification_refusals_are_clear(
    server: Server, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    document = {
        "inputs": [
            {"name": name, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}
            for name in ("INPUT0", "INPUT1")
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 0}}],
    }
    answer = httpx.post(f"{server.url}/v2/models/simple/infer", json=document, timeout=30)
    assert answer.status_code == 400
    assert "'classification' must be a positive integer" in answer.json()["error"]
    output = triton_grpc.InferRequestedOutput("OUTPUT0")
    output._output.parameters["classification"].string_param = "3"
    with pytest.raises(InferenceServerException, match="must be a positive integer"):
        grpc_client.infer("simple", _simple_inputs(triton_grpc), outputs=[output])
    metadata = httpx.get(f"{server.url}/v2", timeout=30).json()
    assert "classification" in metadata["extensions"]
