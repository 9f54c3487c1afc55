"""Operator keys, attacked as an inference-only key holder would: every route and RPC of the
operator API groups (model control and uploads, TorchServe's management API, shared memory,
trace, logging) refused over HTTP and gRPC with real clients; the keys never in the log at
debug level with the verbose level turned up; a client's trace settings unable to fill the
disk; uploads off loopback without a key refused at start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import ROOT, Server, free_port, run_server
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

INFERENCE_KEY = "inference-key-6f1d0c2b9a"
OPERATOR_KEY = "operator-key-3e8a7d5c41"
INFERENCE = {"Authorization": f"Bearer {INFERENCE_KEY}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}
MAX_TRACE_FILES = 4
SIMPLE_CONFIG = (FIXTURES / "simple" / "config.pbtxt").read_text()

OPERATOR_ROUTES = (
    ("model-repository", "POST", "/v2/repository/index"),
    ("model-repository", "GET", "/nograd/placement"),
    ("model-repository", "POST", "/v2/repository/models/simple/load"),
    ("model-repository", "POST", "/v2/repository/models/simple/unload"),
    ("model-repository", "GET", "/models"),
    ("model-repository", "POST", "/models?url=simple.mar"),
    ("model-repository", "GET", "/models/simple"),
    ("model-repository", "PUT", "/models/simple?min_worker=2"),
    ("model-repository", "DELETE", "/models/simple"),
    ("shared-memory", "GET", "/v2/systemsharedmemory/status"),
    ("shared-memory", "POST", "/v2/systemsharedmemory/region/r/register"),
    ("shared-memory", "POST", "/v2/systemsharedmemory/unregister"),
    ("shared-memory", "GET", "/v2/cudasharedmemory/status"),
    ("shared-memory", "POST", "/v2/cudasharedmemory/region/r/register"),
    ("trace", "GET", "/v2/trace/setting"),
    ("trace", "POST", "/v2/trace/setting"),
    ("trace", "POST", "/v2/models/simple/trace/setting"),
    ("logging", "GET", "/v2/logging"),
    ("logging", "POST", "/v2/logging"),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("operator")
    repo = root / "repo"
    repo.mkdir()
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "simple",
        "NOGRAD_MODEL_UPLOADS": "true",
        "NOGRAD_API_KEYS": INFERENCE_KEY,
        "NOGRAD_OPERATOR_API_KEYS": OPERATOR_KEY,
        "NOGRAD_LOG_LEVEL": "debug",
        "NOGRAD_LOG_FORMAT": "text",
        "NOGRAD_TRACE_FILE": str(root / "trace.json"),
        "NOGRAD_TRACE_MAX_FILES": str(MAX_TRACE_FILES),
    }
    with run_server(root, env=env, ready_timeout_s=120) as running:
        yield running


def _http(server: Server) -> triton_http.InferenceServerClient:
    return triton_http.InferenceServerClient(server.url.removeprefix("http://"))


def _grpc(server: Server) -> triton_grpc.InferenceServerClient:
    assert server.grpc_address is not None
    return triton_grpc.InferenceServerClient(server.grpc_address)


def _inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for each in inputs:
        each.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    return inputs


def test_every_operator_route_is_forbidden_to_an_inference_key(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for group, method, path in OPERATOR_ROUTES:
            refused = client.request(method, path, headers=INFERENCE, json={})
            assert refused.status_code == 403, (path, refused.text)
            error = refused.json()["error"]
            assert f"This API is restricted, expecting an operator key: the {group} API" in error
            assert INFERENCE_KEY not in error
            assert client.request(method, path, json={}).status_code == 401, path
        # An upload is a load call: refused before its files are looked at.
        upload = {"parameters": {"config": SIMPLE_CONFIG, "file:1/model.py": "aW1wb3J0IG9z"}}
        path = "/v2/repository/models/fresh/load"
        assert client.post(path, headers=INFERENCE, json=upload).status_code == 403
        # The operator key opens them; the inference key still infers.
        assert client.post("/v2/repository/index", headers=OPERATOR).status_code == 200
        placement = client.get("/nograd/placement", headers=OPERATOR)
        assert placement.status_code == 200, placement.text
        assert {"name": "simple", "state": "resident"}.items() <= placement.json()["models"][
            0
        ].items()
        assert client.get("/v2/logging", headers=OPERATOR).json()["log_error"] is True
        assert client.get("/v2/systemsharedmemory/status", headers=OPERATOR).status_code == 200
    answer = _http(server).infer("simple", _inputs(triton_http), headers=INFERENCE)
    assert answer.as_numpy("OUTPUT0") is not None
    assert "fresh" not in {m["name"] for m in _http(server).get_model_repository_index(OPERATOR)}


def test_operator_rpcs_are_permission_denied_to_an_inference_key(server: Server) -> None:
    client = _grpc(server)
    key = {"authorization": f"Bearer {INFERENCE_KEY}"}
    attacks = (
        lambda: client.load_model("simple", headers=key),
        lambda: client.load_model(
            "fresh", headers=key, config=SIMPLE_CONFIG, files={"file:1/model.py": b"import os"}
        ),
        lambda: client.unload_model("simple", headers=key),
        lambda: client.get_model_repository_index(headers=key),
        lambda: client.register_system_shared_memory("r", "/nograd-victim", 64, headers=key),
        lambda: client.get_system_shared_memory_status(headers=key),
        lambda: client.unregister_system_shared_memory(headers=key),
        lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}, headers=key),
        lambda: client.update_log_settings(settings={"log_error": False}, headers=key),
        lambda: client.get_log_settings(headers=key),
    )
    try:
        for attack in attacks:
            with pytest.raises(InferenceServerException) as refused:
                attack()
            assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
            assert "This protocol is restricted, expecting an operator key" in str(refused.value)
        # Error logging is still on; the model still serves.
        operator = {"authorization": f"Bearer {OPERATOR_KEY}"}
        settings = client.get_log_settings(headers=operator, as_json=True)["settings"]
        assert settings["log_error"]["bool_param"] is True
        assert client.is_model_ready("simple", headers=key)
    finally:
        client.close()


def test_keys_never_reach_the_log_at_any_level(server: Server) -> None:
    """Debug level and Triton's verbose level on, as any operator may set them: hpack then
    decodes each gRPC call's ``authorization``, and no line may carry a key."""
    http = _http(server)
    http.update_log_settings({"log_verbose_level": 1}, headers=OPERATOR)
    assert http.get_log_settings(headers=OPERATOR)["log_verbose_level"] == 1
    grpc = _grpc(server)
    try:
        for _ in range(5):
            key = {"authorization": f"Bearer {INFERENCE_KEY}"}
            assert (
                grpc.infer("simple", _inputs(triton_grpc), headers=key).as_numpy("OUTPUT0")
                is not None
            )
            assert http.infer("simple", _inputs(triton_http), headers=INFERENCE) is not None
        wrong = {"authorization": f"Bearer {INFERENCE_KEY}-wrong"}
        with pytest.raises(InferenceServerException):
            grpc.infer("simple", _inputs(triton_grpc), headers=wrong)
    finally:
        grpc.close()
        http.update_log_settings({"log_verbose_level": 0}, headers=OPERATOR)
    log = server.log()
    assert " DEBUG " in log  # debug lines were written: the level was really on
    assert INFERENCE_KEY not in log and OPERATOR_KEY not in log


def test_trace_files_stay_within_their_count_whatever_a_client_sets(server: Server) -> None:
    """``log_frequency`` 1 writes a file per trace: only the newest few stay on disk."""
    http = _http(server)
    every_request = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "1"}
    http.update_trace_settings(settings=every_request, headers=OPERATOR)
    try:
        for _ in range(3 * MAX_TRACE_FILES):
            http.infer("simple", _inputs(triton_http), headers=INFERENCE)
    finally:
        http.update_trace_settings(settings={"trace_level": ["OFF"]}, headers=OPERATOR)
    root = server.log_path.parent
    deadline = time.monotonic() + 10
    while True:
        files = sorted(int(p.name.rsplit(".", 1)[1]) for p in root.glob("trace.json.*"))
        if files and files[-1] == 3 * MAX_TRACE_FILES - 1:
            break
        assert time.monotonic() < deadline, files
        time.sleep(0.1)
    assert len(files) <= MAX_TRACE_FILES, files


def test_uploads_off_loopback_without_a_key_refuse_to_start(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "NOGRAD_HOST": "0.0.0.0",
        "NOGRAD_PORT": str(free_port()),
        "NOGRAD_GRPC_PORT": "0",
        "NOGRAD_MODEL_REPOSITORY": str(tmp_path),
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_MODEL_UPLOADS": "true",
        "NOGRAD_WORKERS": "1",
    }
    started = subprocess.run(
        [sys.executable, "-m", "nograd"], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert started.returncode != 0
    error = started.stderr.decode(errors="replace")
    assert "NOGRAD_MODEL_UPLOADS on host '0.0.0.0' without NOGRAD_OPERATOR_API_KEYS" in error
