"""Model files sent with a load call (Triton's ``file:<path>`` load parameters), against a real
server with two workers, over tritonclient's HTTP and gRPC clients: the uploaded model serves on
every worker, a load without files goes back to the repository's folder, an unload forgets the
upload; a bad upload answers as Triton 2.51 answers it (500 / INTERNAL, "failed to poll from
model repository") and writes nothing outside the upload; uploads are refused unless turned on."""

from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import Server, free_port, run_server, wait_for_log, worker_pids
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

ADD_SUB = (FIXTURES / "add_sub" / "1" / "model.py").read_bytes()
"""Triton's Python-backend example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
SCALE = b"""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            tensors = [pb_utils.Tensor("OUTPUT0", x * 10), pb_utils.Tensor("OUTPUT1", x * 0)]
            out.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return out
"""
"""Other code under the same inputs and outputs: which files serve shows in the answer."""


def tensor(name: str) -> dict[str, object]:
    return {"name": name, "data_type": "TYPE_FP32", "dims": [4]}


CONFIG = json.dumps(
    {
        "backend": "python",
        "max_batch_size": 0,
        "input": [tensor("INPUT0"), tensor("INPUT1")],
        "output": [tensor("OUTPUT0"), tensor("OUTPUT1")],
    }
)
BODY = {
    "inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]},
        {"name": "INPUT1", "datatype": "FP32", "shape": [4], "data": [1, 1, 1, 1]},
    ]
}
ADDED = [2.0, 3.0, 4.0, 5.0]
SCALED = [10.0, 20.0, 30.0, 40.0]


def repository(root: Path) -> Path:
    """A repository holding ``addsub``: Triton's add_sub example as a folder on disk."""
    folder = root / "repo" / "addsub"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_bytes(ADD_SUB)
    (folder / "config.pbtxt").write_text(
        'name: "addsub"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },'
        ' { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },'
        ' { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )
    return folder.parent


class Uploading:
    def __init__(self, server: Server, grpc_port: int) -> None:
        self.server = server
        self.http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
        self.grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")

    def outputs(self, model: str, requests: int = 12) -> list[list[float]]:
        """OUTPUT0 of ``requests`` inferences, each on a new connection (so both workers answer)."""
        seen = []
        for _ in range(requests):
            url = f"{self.server.url}/v2/models/{model}/infer"
            answer = httpx.post(url, json=BODY, timeout=30)
            assert answer.status_code == 200, answer.text
            outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
            seen.append(outputs["OUTPUT0"])
        return seen


@pytest.fixture(scope="module")
def uploading(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uploading]:
    root = tmp_path_factory.mktemp("uploads")
    grpc_port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repository(root)),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_MODEL_UPLOADS": "true",
        "NOGRAD_LOAD_MODELS": "addsub",
        "NOGRAD_WORKERS": "2",
        "NOGRAD_GRPC_PORT": str(grpc_port),
    }
    with run_server(root, env, ready_timeout_s=180) as server:
        yield Uploading(server, grpc_port)


def test_an_uploaded_model_serves_on_every_worker_until_unloaded(uploading: Uploading) -> None:
    uploading.http.load_model("fresh", config=CONFIG, files={"file:1/model.py": ADD_SUB})
    assert uploading.outputs("fresh") == [ADDED] * 12
    metadata = uploading.grpc.get_model_metadata("fresh", as_json=True)
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]

    uploading.grpc.unload_model("fresh")
    answer = httpx.post(f"{uploading.server.url}/v2/models/fresh/infer", json=BODY, timeout=10)
    assert answer.status_code == 404
    # The upload is forgotten: the repository has no such model.
    with pytest.raises(InferenceServerException, match="failed to load 'fresh'"):
        uploading.http.load_model("fresh")


def test_an_upload_replaces_a_repository_model_until_a_load_without_files(
    uploading: Uploading,
) -> None:
    uploading.grpc.load_model("addsub", config=CONFIG, files={"file:1/model.py": SCALE})
    assert uploading.outputs("addsub") == [SCALED] * 12
    uploading.grpc.load_model("addsub")
    assert uploading.outputs("addsub") == [ADDED] * 12


def test_a_restarted_worker_serves_the_upload_too(uploading: Uploading) -> None:
    uploading.http.load_model("kept", config=CONFIG, files={"file:1/model.py": SCALE})
    pids = worker_pids(uploading.server)
    os.kill(pids[0], signal.SIGKILL)
    wait_for_log(uploading.server, "worker 0 ready after", times=2)
    assert worker_pids(uploading.server)[0] != pids[0]
    assert uploading.outputs("kept") == [SCALED] * 12
    uploading.http.unload_model("kept")


@pytest.mark.parametrize(
    ("files", "config", "reason"),
    [
        ({"file:" + "A" * 256: b"a"}, "{}", "longer than the file system's 255"),
        ({"file:../escaped/model.py": b"a"}, "{}", "must stay within the model's folder"),
        ({"file:/tmp/escaped.py": b"a"}, "{}", "must stay within the model's folder"),
        ({"file:1/model.py": ADD_SUB}, None, "'config' must be specified"),
        ({"file:1/model.py": ADD_SUB}, "{not json", "invalid config override"),
        ({"file:1/model.py": ADD_SUB}, '{"name": "other"}', "differs from the model's"),
    ],
)
def test_a_bad_upload_answers_as_triton_and_writes_nothing(
    uploading: Uploading, files: dict[str, bytes], config: str | None, reason: str, tmp_path: Path
) -> None:
    triton = "failed to load 'addsub', failed to poll from model repository"
    for client in (uploading.http, uploading.grpc):
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("addsub", config=config, files=files)
        status = str(refused.value.status())
        assert status in ("500", "StatusCode.INTERNAL"), status
        message = str(refused.value.message())
        assert message.startswith(triton) and reason in message, message
    assert not Path("/tmp/escaped.py").exists()
    # What served before serves on, and the server is live.
    assert uploading.http.is_server_live()
    assert uploading.outputs("addsub", requests=4) == [ADDED] * 4


def test_uploads_are_refused_unless_turned_on(tmp_path: Path) -> None:
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repository(tmp_path)),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "addsub",
    }
    with run_server(tmp_path, env) as server:
        path = f"{server.url}/v2/repository/models/addsub/load"
        upload = base64.b64encode(SCALE).decode()
        body = {"parameters": {"config": CONFIG, "file:1/model.py": upload}}
        answer = httpx.post(path, json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert "NOGRAD_MODEL_UPLOADS" in answer.json()["error"]
        infer = httpx.post(f"{server.url}/v2/models/addsub/infer", json=BODY, timeout=30)
        outputs = {o["name"]: o["data"] for o in infer.json()["outputs"]}
        assert outputs["OUTPUT0"] == ADDED
