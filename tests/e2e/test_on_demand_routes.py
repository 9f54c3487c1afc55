"""On-demand control beside inference over V2: TorchServe's predictions load an archive on
demand; V2 and gRPC metadata, config and readiness answer a model that is not resident from its
config, without loading it; a request whose deadline is shorter than its model's last load is
refused at once with 503 and Retry-After while the load goes on; one that waited for a first
load (its time unknown) has only what is left of its deadline for its batch."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.serving import Server, free_port, metric_value, run_server
from tests.e2e.test_on_demand import infer, write_model

pytestmark = pytest.mark.e2e

LOAD_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.torchserve_archives import scale_archive

    repo = tmp_path_factory.mktemp("repository")
    scale_archive(repo, tmp_path_factory.mktemp("work"))
    write_model(repo, "cold", 1, 3)
    slow_build = f"def build(model_dir):\n    __import__('time').sleep({LOAD_S})"
    for name in ("sluggish", "unmeasured"):
        write_model(repo, name, 1, 5)
        code = repo / name / "model.py"
        code.write_text(code.read_text().replace("def build(model_dir):", slow_build))
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": "64MiB",
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    with run_server(tmp_path_factory.mktemp("log"), env) as running:
        yield running


def test_torchserve_predictions_load_an_archive_on_demand(server: Server) -> None:
    answer = httpx.post(f"{server.url}/predictions/scale", json={"x": [1.0, 2.0, 3.0, 4.0]})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["y"]) == 2
    assert metric_value(server.url, "nograd_model_loads_total", model="scale") == 1
    missing = httpx.post(f"{server.url}/predictions/nowhere", json={"x": [1.0]})
    assert missing.status_code == 404, missing.text


def test_metadata_config_and_readiness_answer_without_loading(server: Server) -> None:
    import tritonclient.grpc as triton

    url = server.url
    with httpx.Client(base_url=url, timeout=60) as client:
        metadata = client.get("/v2/models/cold")
        assert metadata.status_code == 200, metadata.text
        described = metadata.json()
        assert (described["name"], described["versions"]) == ("cold", ["1"])
        assert [tensor["name"] for tensor in described["inputs"]] == ["x"]
        config = client.get("/v2/models/cold/config")
        assert config.status_code == 200, config.text
        assert config.json()["name"] == "cold"
        ready = client.get("/v2/models/cold/ready")
        assert (ready.status_code, ready.json()) == (503, {"name": "cold", "ready": False})
        assert client.get("/v2/models/nowhere").status_code in (400, 404)
        assert client.get("/v2/models/nowhere/ready").status_code in (400, 404)

        assert server.grpc_address is not None
        grpc_client = triton.InferenceServerClient(server.grpc_address)
        try:
            assert grpc_client.get_model_metadata("cold").name == "cold"
            assert grpc_client.get_model_config("cold").config.name == "cold"
            assert grpc_client.is_model_ready("cold") is False
            assert metric_value(url, "nograd_model_loads_total", model="cold") == 0
            assert infer(client, "cold").status_code == 200
            assert grpc_client.is_model_ready("cold") is True
        finally:
            grpc_client.close()
        assert client.get("/v2/models/cold/ready").status_code == 200


def timed_infer(client: httpx.Client, name: str, timeout_us: int) -> httpx.Response:
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
        "parameters": {"timeout": timeout_us},
    }
    return client.post(f"/v2/models/{name}/infer", json=body)


def test_a_deadline_shorter_than_the_load_is_refused_at_once(server: Server) -> None:
    url = server.url
    with httpx.Client(base_url=url, timeout=60) as client:
        # Nothing measured yet: the request waits for the load, however short its deadline.
        assert timed_infer(client, "sluggish", 10_000_000).status_code == 200
        unload = client.post("/v2/repository/models/sluggish/unload")
        assert unload.status_code == 200, unload.text

        started = time.perf_counter()
        refused = timed_infer(client, "sluggish", 500_000)
        took = time.perf_counter() - started
        assert refused.status_code == 503, refused.text
        assert "expected to take" in refused.json()["error"]
        assert int(refused.headers["Retry-After"]) >= LOAD_S
        assert took < LOAD_S, took
        assert metric_value(url, "nograd_rejected_total", reason="load_too_slow") == 1

        # The load went on: after Retry-After the model answers.
        time.sleep(int(refused.headers["Retry-After"]))
        deadline = time.monotonic() + 30
        while (answer := timed_infer(client, "sluggish", 500_000)).status_code == 503:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.5)
        assert answer.status_code == 200, answer.text
        assert metric_value(url, "nograd_model_loads_total", model="sluggish") == 2


def test_a_request_that_waited_for_a_first_load_keeps_its_deadline(server: Server) -> None:
    """No load of the model measured yet: the request waits for it, and its deadline still
    counts from its arrival, so a load longer than the deadline leaves its batch no time."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        started = time.perf_counter()
        late = timed_infer(client, "unmeasured", 500_000)
        waited = time.perf_counter() - started
        assert late.status_code == 504, late.text
        assert "deadline passed" in late.json()["error"]
        assert waited >= LOAD_S, waited
        # The load completed: the model answers within the same deadline now.
        assert timed_infer(client, "unmeasured", 500_000).status_code == 200
