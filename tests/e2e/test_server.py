"""The real server over HTTP: health, metadata, inference, errors, metrics, docs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nograd.host.openmp import SPIN_COUNT
from tests.conftest import OPERATOR_SET_OPENMP_WAIT
from tests.e2e.serving import ROOT, Server, digits_repository, run_server

pytestmark = pytest.mark.e2e

SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())
DIGITS = "/v2/models/digits/infer"


def digits_body(images: np.ndarray, **extra: object) -> dict[str, object]:
    return {
        "inputs": [
            {
                "name": "image",
                "shape": list(images.shape),
                "datatype": "FP32",
                "data": images.reshape(-1).tolist(),
            }
        ],
        **extra,
    }


def heldout_images(count: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(0, 17, size=(count, 1, 8, 8)).astype(np.float32)


def output(document: dict[str, object], name: str) -> np.ndarray:
    outputs = document["outputs"]
    assert isinstance(outputs, list)
    for out in outputs:
        if out["name"] == name:
            return np.asarray(out["data"]).reshape(out["shape"])
    raise AssertionError(f"no output {name}")


def metrics(server: Server) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    text = httpx.get(f"{server.url}/metrics").text
    found: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(family.name, []).append((sample.labels, sample.value, sample.name))
    return found


def test_health_and_server_metadata(server: Server) -> None:
    assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
    meta = httpx.get(f"{server.url}/v2").json()
    assert meta["name"] == "nograd"
    assert isinstance(meta["extensions"], list)


@pytest.mark.skipif(
    OPERATOR_SET_OPENMP_WAIT,
    reason="the environment sets the OpenMP wait policy itself, which the server keeps",
)
def test_a_single_process_keeps_openmp_threads_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set by the command before torch loads (nograd/host/openmp.py); the log says so. A server
    of its own, without the wait policy the suite sets for its parallel pass."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with run_server(tmp_path, {"NOGRAD_MODEL_REPOSITORY": str(digits_repository(tmp_path))}) as one:
        assert f"OpenMP threads spin up to {SPIN_COUNT} iterations between batches" in one.log()


def test_model_metadata_shows_batch_dimension(server: Server) -> None:
    for path in ("/v2/models/digits", "/v2/models/digits/versions/1"):
        meta = httpx.get(server.url + path).json()
        assert meta["name"] == "digits"
        assert meta["versions"] == ["1"]
        assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
        assert {"name": "logits", "datatype": "FP32", "shape": [-1, 10]} in meta["outputs"]
    ready = httpx.get(f"{server.url}/v2/models/digits/ready")
    assert (ready.status_code, ready.content) == (200, b"")  # as Triton: the status answers
    assert httpx.get(f"{server.url}/v2/models/digits/versions/1/ready").status_code == 200


def test_infer_sample_predicts_true_labels(server: Server) -> None:
    response = httpx.post(server.url + DIGITS, json={**SAMPLE, "id": "req-1"})
    assert response.status_code == 200, response.text
    document = response.json()
    assert document["model_name"] == "digits"
    assert document["id"] == "req-1"
    probabilities = output(document, "probabilities")
    assert probabilities.shape == (2, 10)
    assert np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    labels = output(document, "label")
    assert labels.shape == (2, 1)
    assert (labels.reshape(-1) == np.argmax(output(document, "logits"), axis=1)).all()


def test_versioned_infer_and_requested_output_subset(server: Server) -> None:
    body = {**SAMPLE, "outputs": [{"name": "label"}]}
    document = httpx.post(f"{server.url}/v2/models/digits/versions/1/infer", json=body).json()
    assert [o["name"] for o in document["outputs"]] == ["label"]


def test_multi_row_request_gets_its_rows_in_order(server: Server) -> None:
    images = heldout_images(40)
    together = httpx.post(server.url + DIGITS, json=digits_body(images)).json()
    logits = output(together, "logits")
    assert logits.shape == (40, 10)
    for index in (0, 17, 39):
        alone = httpx.post(server.url + DIGITS, json=digits_body(images[index : index + 1])).json()
        assert np.allclose(output(alone, "logits")[0], logits[index], atol=1e-5)


async def test_concurrent_requests_are_batched_and_match_unbatched(server: Server) -> None:
    images = heldout_images(64)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        alone = [
            output(
                (await client.post(DIGITS, json=digits_body(images[i : i + 1]))).json(), "logits"
            )
            for i in range(len(images))
        ]
        # The batcher is work-conserving: a request that finds the model idle runs at once, so
        # whether a wave of a sub-millisecond model overlaps depends on the machine's load. Up to
        # three waves; every answer must match, and at least one wave must have been batched.
        waves = []
        for _ in range(3):
            before = _batch_size_stats(server)
            responses = await asyncio.gather(
                *(
                    client.post(DIGITS, json=digits_body(images[i : i + 1]))
                    for i in range(len(images))
                )
            )
            after = _batch_size_stats(server)
            for index, response in enumerate(responses):
                assert response.status_code == 200
                assert np.allclose(output(response.json(), "logits"), alone[index], atol=1e-5)
            assert after[1] - before[1] == len(images)
            waves.append(after[0] - before[0])
            if waves[-1] < len(images):
                break
    assert min(waves) < len(images), f"64 concurrent requests all ran alone: {waves} batches"


def _batch_size_stats(server: Server) -> tuple[float, float]:
    samples = metrics(server)["nograd_batch_size"]
    count = sum(
        v for labels, v, name in samples if name.endswith("_count") and labels["model"] == "digits"
    )
    total = sum(
        v for labels, v, name in samples if name.endswith("_sum") and labels["model"] == "digits"
    )
    return count, total


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[]", 400, "JSON object"),
        (b'{"inputs": []}', 400, "inputs"),
        (
            b'{"inputs":[{"name":"image","shape":[1,1,8,8],"datatype":"FP32","data":[1,2]}]}',
            400,
            "needs 64 elements",
        ),
        (
            b'{"inputs":[{"name":"image","shape":[1,64],"datatype":"FP32","data":'
            + json.dumps([0.0] * 64).encode()
            + b"}]}",
            400,
            "unexpected shape for input 'image' for model 'digits'. Expected [-1,1,8,8], "
            "got [1,64]",
        ),
        (
            b'{"inputs":[{"name":"image","shape":[1,1,8,8],"datatype":"INT32","data":'
            + json.dumps([0] * 64).encode()
            + b"}]}",
            400,
            "inference input 'image' data-type is 'INT32', but model 'digits' expects 'FP32'",
        ),
        (
            b'{"inputs":[{"name":"pixels","shape":[1,1,8,8],"datatype":"FP32","data":'
            + json.dumps([0] * 64).encode()
            + b"}]}",
            400,
            "unexpected inference input 'pixels' for model 'digits'",
        ),
        (
            b'{"inputs":[{"name":"image","shape":[1,1,8,8],"datatype":"FP32","data":'
            + json.dumps(["a"] * 64).encode()
            + b"}]}",
            400,
            "string",
        ),
        (
            b'{"inputs":[{"name":"image","shape":[1,1,8,8],"datatype":"FLOAT","data":[]}]}',
            400,
            "datatype",
        ),
        (
            b'{"inputs":[{"name":"image","shape":[0,1,8,8],"datatype":"FP32","data":[]}]}',
            400,
            "zero rows",
        ),
        (
            b'{"inputs":[{"name":"image","shape":[1,1,8,8],"datatype":"FP32","data":'
            + json.dumps([0] * 64).encode()
            + b'}],"outputs":[{"name":"nope"}]}',
            400,
            "nope",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_problem(
    server: Server, body: bytes, status: int, fragment: str
) -> None:
    response = httpx.post(
        server.url + DIGITS, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]


def test_unknown_model_or_version_is_404(server: Server) -> None:
    for method, path in (
        ("GET", "/v2/models/nope"),
        ("GET", "/v2/models/nope/ready"),
        ("GET", "/v2/models/digits/versions/9"),
        ("POST", "/v2/models/nope/infer"),
        ("POST", "/v2/models/digits/versions/9/infer"),
    ):
        response = httpx.request(method, server.url + path, json=SAMPLE)
        assert response.status_code == 404, (path, response.text)
        assert "error" in response.json()


def test_metrics_exposition(server: Server) -> None:
    httpx.post(server.url + DIGITS, json=SAMPLE)
    httpx.post(
        f"{server.url}/v2/models/random-name-{np.random.randint(1 << 30)}/infer", json=SAMPLE
    )
    found = metrics(server)
    for name in (
        "nograd_requests",
        "nograd_request_duration_seconds",
        "nograd_queue_duration_seconds",
        "nograd_batch_duration_seconds",
        "nograd_batch_size",
        "nograd_queue_depth",
        "nograd_inflight_requests",
        "nograd_device_memory_allocated_bytes",
        "nograd_device_memory_reserved_bytes",
        "nograd_device_memory_peak_bytes",
        "nograd_device_memory_total_bytes",
        "nograd_model_load_seconds",
        "nograd_model_warmup_seconds",
    ):
        assert name in found, name
    ok = [
        v
        for labels, v, sample in found["nograd_requests"]
        if labels == {"model": "digits", "protocol": "v2", "code": "200"}
    ]
    assert ok and ok[0] >= 1
    assert [v for _, v, _ in found["nograd_workers_ready"]] == [1.0]
    models = {labels["model"] for labels, _, _ in found["nograd_requests"]}
    assert not any(m.startswith("random-name") for m in models), "raw model names leak into labels"
    buckets = [
        float(labels["le"])
        for labels, _, sample in found["nograd_request_duration_seconds"]
        if sample.endswith("_bucket") and labels["le"] != "+Inf"
    ]
    assert min(buckets) <= 0.0005 and max(buckets) >= 10
    batch_buckets = sorted(
        {
            float(labels["le"])
            for labels, _, sample in found["nograd_batch_size"]
            if sample.endswith("_bucket") and labels["le"] != "+Inf"
        }
    )
    assert batch_buckets[:4] == [1.0, 2.0, 4.0, 8.0]
    total = [
        v for labels, v, _ in found["nograd_device_memory_total_bytes"] if labels["device"] == "cpu"
    ]
    assert total and total[0] > 0


def test_openapi_docs(server: Server) -> None:
    assert httpx.get(f"{server.url}/docs").status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()
    infer = schema["paths"]["/v2/models/{name}/infer"]["post"]
    assert infer["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "InferRequestDocument"
    )
    assert "InferRequestDocument" in schema["components"]["schemas"]
    assert {"400", "404", "503"} <= set(infer["responses"])


def test_models_folder_is_the_default_repository() -> None:
    assert (ROOT / "models" / "digits" / "config.toml").is_file()
    assert Path(ROOT / "models" / "digits" / "model.safetensors").stat().st_size < 1_000_000
