"""Model control against a real server with two workers: digits v1 to v2 under concurrent load
with no failed request, every worker switched when the load answers, the same index from every
worker, overrides (batching and queueing only) and unload over tritonclient's HTTP and gRPC
clients."""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import ROOT, Server, free_port, run_server
from tests.e2e.test_on_demand import write_model

pytestmark = pytest.mark.e2e

DIGITS = ROOT / "models" / "digits"
SAMPLE = json.loads((DIGITS / "sample.json").read_text())
BODY = {"inputs": SAMPLE["inputs"]}
VERSION_FILES = ("model.py", "model.safetensors", "sample.json")


def add_version(repo: Path, version: int) -> None:
    folder = repo / "digits" / str(version)
    folder.mkdir(parents=True)
    for name in VERSION_FILES:
        shutil.copy2(DIGITS / name, folder / name)


class Served:
    def __init__(self, server: Server, repo: Path, grpc_port: int) -> None:
        self.server = server
        self.repo = repo
        self.grpc_url = f"127.0.0.1:{grpc_port}"

    @property
    def url(self) -> str:
        return self.server.url

    def http_client(self) -> triton_http.InferenceServerClient:
        return triton_http.InferenceServerClient(self.url.removeprefix("http://"))

    def versions_answering(self, requests: int = 24) -> Counter[str]:
        """The version of each of ``requests`` inferences, each on a new connection (so the
        supervisor spreads them over both workers)."""
        seen: Counter[str] = Counter()
        for _ in range(requests):
            answer = httpx.post(f"{self.url}/v2/models/digits/infer", json=BODY, timeout=10)
            assert answer.status_code == 200, answer.text
            seen[answer.json()["model_version"]] += 1
        return seen


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("repository")
    (repo / "digits").mkdir()
    shutil.copy2(DIGITS / "config.toml", repo / "digits" / "config.toml")
    add_version(repo, 1)
    port = free_port()
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_WORKERS": "2",
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "digits",
        "NOGRAD_GRPC_PORT": str(port),
    }
    with run_server(tmp_path_factory.mktemp("log"), env) as server:
        yield Served(server, repo, port)


def test_a_reload_under_load_fails_no_request_on_any_worker(served: Served) -> None:
    assert set(served.versions_answering()) == {"1"}
    statuses: Counter[int] = Counter()
    versions: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        # Short-lived connections, so both workers take requests throughout.
        while not stop.is_set():
            with httpx.Client(base_url=served.url, timeout=30) as http:
                for _ in range(5):
                    answer = http.post("/v2/models/digits/infer", json=BODY)
                    with lock:
                        statuses[answer.status_code] += 1
                        if answer.status_code == 200:
                            versions[answer.json()["model_version"]] += 1

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        add_version(served.repo, 2)
        served.http_client().load_model("digits")
        # The load answers once every worker applied it: no worker still serves version 1.
        assert set(served.versions_answering()) == {"2"}
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert set(statuses) == {200}, statuses
    assert versions["1"] > 0 and versions["2"] > 0, versions
    server_log = served.server.log()
    assert server_log.count("model digits v1 unloaded (replaced by a newer load)") == 0
    assert server_log.count("model digits v1 unloaded (no longer selected)") == 2, "each worker"


def test_every_worker_answers_the_same_index(served: Served) -> None:
    indexes = {httpx.post(f"{served.url}/v2/repository/index", timeout=10).text for _ in range(12)}
    assert len(indexes) == 1
    (index,) = indexes
    assert json.loads(index) == [{"name": "digits", "version": "2", "state": "READY"}]
    metadata = httpx.get(f"{served.url}/v2/models/digits", timeout=10).json()
    assert metadata["versions"] == ["2"]


def test_grpc_load_with_an_override_and_unload(served: Served) -> None:
    client = triton_grpc.InferenceServerClient(served.grpc_url)
    client.load_model("digits", config=json.dumps({"max_batch_size": 16}))
    for _ in range(8):
        config = httpx.get(f"{served.url}/v2/models/digits/config", timeout=10).json()
        assert config["parameters"]["batch_limit"] == {"string_value": "16"}
    with pytest.raises(InferenceServerException, match="max_batch_sise"):
        client.load_model("digits", config=json.dumps({"max_batch_sise": 16}))

    client.unload_model("digits")
    for _ in range(8):
        answer = httpx.post(f"{served.url}/v2/models/digits/infer", json=BODY, timeout=10)
        assert answer.status_code == 404
        assert "unloaded by request" in answer.json()["error"]
    index = client.get_model_repository_index(as_json=True)["models"]
    assert index == [{"name": "digits", "state": "UNAVAILABLE", "reason": "unloaded by request"}]
    assert httpx.get(f"{served.url}/v2/health/ready", timeout=10).status_code == 200

    served.http_client().load_model("digits")
    assert set(served.versions_answering()) == {"2"}


CYCLE_ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 4
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
ensemble_scheduling {{
  step [ {{
    model_name: "{step}"
    model_version: -1
    input_map {{ key: "x" value: "x" }}
    output_map {{ key: "y" value: "y" }}
  }} ]
}}
"""


def write_ensemble(repo: Path, name: str, step: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(CYCLE_ENSEMBLE.format(name=name, step=step))


def test_a_reload_that_would_close_an_ensemble_cycle_is_refused(served: Served) -> None:
    """Ensemble ``outer`` runs ``inner``; ``inner`` is then reloaded as an ensemble over
    ``outer``. The load is refused (400 naming the cycle, on every worker) and the server stays
    ready: readiness never walks a cycle."""
    repo = served.repo
    write_model(repo, "inner", 1, 3)
    write_ensemble(repo, "outer", "inner")
    control = f"{served.url}/v2/repository/models"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}]}
    try:
        assert httpx.post(f"{control}/outer/load", timeout=120).status_code == 200
        shutil.rmtree(repo / "inner")
        write_ensemble(repo, "inner", "outer")
        answer = httpx.post(f"{control}/inner/load", timeout=120)
        assert answer.status_code == 400, answer.text
        assert (
            "circular dependency between ensembles: inner -> ... -> outer -> inner"
            in (answer.json()["error"])
        )
        for _ in range(8):  # new connections: both workers
            assert httpx.get(f"{served.url}/v2/health/ready", timeout=10).status_code == 200
            assert httpx.get(f"{served.url}/ping", timeout=10).status_code == 200
            ran = httpx.post(f"{served.url}/v2/models/outer/infer", json=body, timeout=10)
            assert ran.status_code == 200, ran.text  # the version of inner before serves on
            assert ran.json()["outputs"][0]["data"] == [3.5]
    finally:
        for name in ("outer", "inner"):
            httpx.post(f"{control}/{name}/unload", timeout=120)
            shutil.rmtree(repo / name, ignore_errors=True)


def test_a_load_override_changes_batching_and_queueing_only(tmp_path: Path) -> None:
    """The attacks a load call's config once let through: a version that walked out of the
    engine cache (the ONNX file written elsewhere), another name (another copy of the model per
    call), other code, no digest. Each is a 400 (INVALID_ARGUMENT over gRPC) naming the field,
    nothing is written, and the batching override an operator needs still applies."""
    cache = tmp_path / "cache"
    outside = tmp_path / "outside"
    grpc_port = free_port()
    env = {
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "digits",
        # Loading builds an engine file, the one a bad version once put outside the cache.
        "NOGRAD_ENGINE": "onnx",
        "NOGRAD_ENGINE_CACHE": str(cache),
        "NOGRAD_GRPC_PORT": str(grpc_port),
    }
    with run_server(tmp_path, env, ready_timeout_s=240) as server:
        built = sorted(cache.iterdir())
        assert any(path.suffix == ".onnx" for path in built), built

        def load(fields: dict[str, object]) -> httpx.Response:
            body = {"parameters": {"config": json.dumps(fields)}}
            url = f"{server.url}/v2/repository/models/digits/load"
            return httpx.post(url, json=body, timeout=120)

        for fields in (
            {"version": "x/../../outside/pwn"},
            {"name": "evil1"},
            {"module": "train.py"},
            {"artifact_sha256": None},
        ):
            answer = load(fields)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            (field,) = fields
            assert f"{field!r} cannot be overridden" in error and "max_batch_size" in error
        for field, bound in (("max_queue_size", 65536), ("max_batch_tokens", 1 << 20)):
            answer = load({field: 10**15})
            assert answer.status_code == 400, answer.text
            assert f"{field!r} must be a whole number from 1 to {bound}" in answer.json()["error"]
        assert not outside.exists()
        assert sorted(cache.iterdir()) == built
        index = httpx.post(f"{server.url}/v2/repository/index", timeout=10).json()
        assert "evil1" not in {entry["name"] for entry in index}

        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("digits", config=json.dumps({"weights": "train.py"}))
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "'weights' cannot be overridden" in str(refused.value.message())

        assert load({"max_batch_size": 16}).status_code == 200
        config = httpx.get(f"{server.url}/v2/models/digits/config", timeout=10).json()
        assert config["parameters"]["batch_limit"] == {"string_value": "16"}
        answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=BODY, timeout=10)
        assert answer.status_code == 200, answer.text


def test_control_calls_need_an_operator_key_when_keys_are_set(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    env = {
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_API_KEYS": "inference-secret",
        "NOGRAD_OPERATOR_API_KEYS": "operator-secret",
    }
    with run_server(tmp_path_factory.mktemp("keys"), env) as server:
        for action in ("load", "unload"):
            path = f"{server.url}/v2/repository/models/digits/{action}"
            assert httpx.post(path, timeout=10).status_code == 401
            inference = {"Authorization": "Bearer inference-secret"}
            refused = httpx.post(path, headers=inference, timeout=10)
            assert refused.status_code == 403
            assert "the model-repository API takes operator keys only" in refused.json()["error"]
            authorized = {"Authorization": "Bearer operator-secret"}
            assert httpx.post(path, headers=authorized, timeout=60).status_code == 200
