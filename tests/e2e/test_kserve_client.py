"""KServe's own Python client (``kserve.inference_client.InferenceGRPCClient``, PyPI ``kserve``)
against a running nograd over gRPC, unchanged: server liveness and readiness, model readiness,
inference on digits with raw and with typed tensors, agreeing with HTTP.

The client has no metadata call, so model and server metadata go through the stub KServe
generates from its own V2 proto: nograd serves Triton's proto, a superset of KServe's, and a KServe
client must read it unchanged. KServe's calls run in a process of their own
(``tests/e2e/kserve_calls.py``): its proto and Triton's cannot share one process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.serving import ROOT, Server, metric_value

pytestmark = pytest.mark.e2e

SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())["inputs"][0]


@pytest.fixture(scope="module")
def found(server: Server) -> Iterator[dict[str, Any]]:
    """What KServe's client saw, the HTTP route's outputs, and the gRPC requests counted."""
    answer = httpx.post(
        f"{server.url}/v2/models/digits/infer", json={"inputs": [SAMPLE]}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    labels = {"model": "digits", "protocol": "grpc", "code": "200"}
    before = metric_value(server.url, "nograd_requests_total", **labels)
    run = subprocess.run(
        [sys.executable, "-m", "tests.e2e.kserve_calls", str(server.grpc_address)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    document: dict[str, Any] = json.loads(run.stdout)
    document["over_http"] = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    document["grpc_requests"] = metric_value(server.url, "nograd_requests_total", **labels) - before
    yield document


def test_server_and_model_health(found: dict[str, Any]) -> None:
    assert found["live"] and found["ready"]
    assert found["models_ready"] == {"digits": True, "minilm": True, "nope": False}


def test_model_and_server_metadata_through_kserves_proto(found: dict[str, Any]) -> None:
    model = found["metadata"]
    assert model["name"] == "digits" and "1" in model["versions"] and model["platform"]
    assert model["inputs"] == [["image", "FP32", [-1, 1, 8, 8]]]
    assert sorted(model["outputs"]) == [
        ["label", "INT64", [-1, 1]],
        ["logits", "FP32", [-1, 10]],
        ["probabilities", "FP32", [-1, 10]],
    ]
    assert found["server"]["name"] == "nograd" and found["server"]["version"]
    assert found["unknown_model"] == "NOT_FOUND"


@pytest.mark.parametrize("kind", ["raw", "typed"])
def test_infer_digits_matches_http(found: dict[str, Any], kind: str) -> None:
    """nograd answers raw either way, which KServe decodes."""
    response = found[kind]
    assert response["id"] == f"kserve-{kind == 'raw'}" and response["model_name"] == "digits"
    outputs = response["outputs"]
    assert set(outputs) == {"logits", "probabilities", "label"}
    assert outputs["label"]["shape"] == [len(SAMPLE["data"]) // 64, 1]
    assert outputs["label"]["data"] == found["over_http"]["label"]
    assert np.allclose(outputs["logits"]["data"], found["over_http"]["logits"], atol=1e-5)
    probabilities = np.asarray(outputs["probabilities"]["data"]).reshape(-1, 10)
    assert np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)


def test_requested_outputs_and_metrics(found: dict[str, Any]) -> None:
    assert found["label_only"] == ["label"]
    assert found["grpc_requests"] == 3, "raw, typed and label-only inferences over gRPC"
