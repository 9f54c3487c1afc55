"""Model files sent with a load call (Triton's ``file:<path>`` load parameters), against a real
server with two workers, over tritonclient's HTTP and gRPC clients: the uploaded model serves on
every worker, a load without files goes back to the repository's folder, an unload forgets the
upload; a bad upload answers as Triton 2.51 answers it (500 / INTERNAL, "failed to poll from
model repository") and writes nothing outside the upload; an upload whose load fails leaves
nothing on disk; the uploads kept stay within their count and bytes; a malformed or oversized
upload is a 400 that leaves the connection usable and the event loop free; uploads are refused
unless turned on."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
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


MAX_UPLOADS = 3
MAX_UPLOAD_BYTES = 3 << 20
BROKEN = b"raise RuntimeError('this model does not load')\n"
"""A model.py whose import fails: its upload is written, then its load fails."""


class Uploading:
    def __init__(self, server: Server, grpc_port: int, shared: Path) -> None:
        self.server = server
        self.uploads = shared / "uploads"
        """The uploads folder of the server's workers (in the folder they share)."""
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
    shared = root / "shared"
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(shared),
        "NOGRAD_MAX_UPLOADS": str(MAX_UPLOADS),
        "NOGRAD_MAX_UPLOAD_BYTES": str(MAX_UPLOAD_BYTES),
        "NOGRAD_MODEL_REPOSITORY": str(repository(root)),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_MODEL_UPLOADS": "true",
        "NOGRAD_LOAD_MODELS": "addsub",
        "NOGRAD_WORKERS": "2",
        "NOGRAD_GRPC_PORT": str(grpc_port),
    }
    with run_server(root, env, ready_timeout_s=180) as server:
        yield Uploading(server, grpc_port, shared)


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


def kept(uploading: Uploading) -> list[str]:
    """The uploads on disk: the models' folders, and whatever is left in staging."""
    staging = uploading.uploads / ".staging"
    models = [p.name for p in uploading.uploads.iterdir() if p.name != ".staging"]
    return sorted(models + [f"staging/{p.name}" for p in staging.iterdir()])


def index_names(uploading: Uploading) -> set[str]:
    index = httpx.post(f"{uploading.server.url}/v2/repository/index", timeout=30).json()
    return {row["name"] for row in index}


def test_an_upload_whose_load_fails_leaves_nothing_on_disk(uploading: Uploading) -> None:
    ballast = b"\0" * (1 << 20)
    for attempt in range(4):
        client = uploading.http if attempt % 2 else uploading.grpc
        with pytest.raises(InferenceServerException, match="this model does not load"):
            client.load_model(
                f"broken{attempt}",
                config=CONFIG,
                files={"file:1/model.py": BROKEN, "file:1/ballast.bin": ballast},
            )
    assert kept(uploading) == []
    assert not {f"broken{attempt}" for attempt in range(4)} & index_names(uploading)
    # A failed upload under a serving upload's name puts that one back: it serves on, on
    # every worker, and a worker that reads it again reads the one that serves.
    uploading.http.load_model("kept2", config=CONFIG, files={"file:1/model.py": SCALE})
    with pytest.raises(InferenceServerException, match="this model does not load"):
        uploading.grpc.load_model("kept2", config=CONFIG, files={"file:1/model.py": BROKEN})
    assert kept(uploading) == ["kept2"]
    assert (uploading.uploads / "kept2" / "1" / "model.py").read_bytes() == SCALE
    assert uploading.outputs("kept2", requests=6) == [SCALED] * 6
    uploading.http.unload_model("kept2")
    assert kept(uploading) == []


def test_the_uploads_kept_stay_within_their_count_and_bytes(uploading: Uploading) -> None:
    ballast = {"file:1/ballast.bin": b"\0" * (2 << 20)}
    uploading.http.load_model("up0", config=CONFIG, files={"file:1/model.py": ADD_SUB, **ballast})
    with pytest.raises(InferenceServerException) as over_bytes:
        uploading.grpc.load_model(
            "up1", config=CONFIG, files={"file:1/model.py": ADD_SUB, **ballast}
        )
    assert str(over_bytes.value.status()) == "StatusCode.FAILED_PRECONDITION"
    message = str(over_bytes.value.message())
    assert message.startswith("failed to load 'up1', ") and "NOGRAD_MAX_UPLOAD_BYTES" in message
    for name in ("up1", "up2"):
        uploading.http.load_model(name, config=CONFIG, files={"file:1/model.py": ADD_SUB})
    with pytest.raises(InferenceServerException) as over_count:
        uploading.http.load_model("up3", config=CONFIG, files={"file:1/model.py": ADD_SUB})
    assert str(over_count.value.status()) == "400"
    assert f"NOGRAD_MAX_UPLOADS={MAX_UPLOADS}" in str(over_count.value.message())
    assert kept(uploading) == ["up0", "up1", "up2"]
    # Replacing a kept upload is not one more; unloading one makes room.
    uploading.http.load_model("up2", config=CONFIG, files={"file:1/model.py": SCALE})
    uploading.http.unload_model("up0")
    uploading.http.load_model("up3", config=CONFIG, files={"file:1/model.py": ADD_SUB})
    assert uploading.outputs("up3", requests=2) == [ADDED] * 2
    for name in ("up1", "up2", "up3"):
        uploading.http.unload_model(name)
    assert kept(uploading) == []


def test_a_malformed_upload_is_a_400_on_a_connection_that_stays_usable(
    uploading: Uploading,
) -> None:
    """One client, one kept-alive connection: each refusal is a 400 naming the problem, and the
    request after it on the same connection is answered."""
    model = base64.b64encode(ADD_SUB).decode()
    deep = "[" * 20_000 + "]" * 20_000
    attacks = [
        ({"config": CONFIG, "file:1/mo\u0000del.py": model}, "NUL character"),
        ({"config": deep, "file:1/model.py": model}, "nested too deeply"),
        ({"config": deep}, "nested too deeply"),
    ]
    with httpx.Client(base_url=uploading.server.url, timeout=30) as client:
        for parameters, reason in attacks:
            answer = client.post("/v2/repository/models/m/load", json={"parameters": parameters})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"].startswith("failed to load 'm', ")
            assert reason in answer.json()["error"]
            assert client.get("/v2/health/live").status_code == 200
    assert kept(uploading) == []


def health_while(send: Callable[[], httpx.Response], url: str) -> tuple[httpx.Response, float]:
    """``send``'s answer, and the slowest of the health calls made on one connection while it
    was on its way."""
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(send()))
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=30) as health:
        sender.start()
        while sender.is_alive():
            started = time.monotonic()
            assert health.get("/v2/health/live").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.02)
    sender.join()
    return answers[0], slowest


def test_a_large_config_is_refused_before_it_is_parsed(uploading: Uploading) -> None:
    """A config of many megabytes is refused by its size, and one just within the bound loads,
    while health answers at once."""
    model = base64.b64encode(ADD_SUB).decode()
    url = f"{uploading.server.url}/v2/repository/models/large/load"

    def config_of(parameters: int) -> str:
        fields = {f"p{i}": {"string_value": "v" * 40} for i in range(parameters)}
        return json.dumps({**json.loads(CONFIG), "parameters": fields})

    huge, within = config_of(200_000), config_of(900)
    assert len(within) < 65536 < len(huge)
    for config, status in ((huge, 400), (within, 200)):
        body = {"parameters": {"config": config, "file:1/model.py": model}}
        answer, slowest = health_while(
            lambda body=body: httpx.post(url, json=body, timeout=60), uploading.server.url
        )
        assert answer.status_code == status, answer.text
        assert status == 200 or "over the limit of 65536 bytes" in answer.json()["error"]
        assert slowest < 1.0, slowest
    uploading.http.unload_model("large")
    assert kept(uploading) == []


def test_a_failed_load_names_no_server_folder(uploading: Uploading) -> None:
    repository = str(uploading.server.log_path.parent)
    for name, files in (("absent", None), ("broken", {"file:1/model.py": BROKEN})):
        with pytest.raises(InferenceServerException) as refused:
            uploading.http.load_model(name, config=CONFIG if files else None, files=files)
        message = str(refused.value.message())
        assert message.startswith(f"failed to load '{name}', "), message
        assert repository not in message and str(uploading.uploads) not in message, message
        assert "/tmp" not in message and ", line " not in message, message
    assert "this model does not load" in message
    assert str(uploading.uploads) in uploading.server.log()
