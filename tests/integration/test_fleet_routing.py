"""HAProxy on deploy/fleet/haproxy.cfg, in front of three small HTTP servers that answer every
request with their own name: what is under test is the balancer's configuration, which replica
each kind of request goes to. Every way a client names a model (V2 path, TorchServe path,
OpenAI model path, the embeddings call's JSON body, the x-nograd-model header, the model control
path) sends that model to the same replica; different models spread over the replicas; a 503
is answered again by another replica; ``roundrobin`` ignores the model."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from nograd.fleet.balancer import CONFIG, RuntimeApi, balancer_env, start_balancer
from nograd.fleet.replicas import stop_process
from tests.e2e.serving import free_port
from tests.prometheus_tools import haproxy

pytestmark = pytest.mark.integration

REPLICAS = 3
MODELS = [f"model-{index}" for index in range(12)]


class NamedReplica(ThreadingHTTPServer):
    """Answers ``{"replica": name}`` to everything, ready to health checks; 503 to the paths in
    ``refuse``."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.name = name
        self.refuse: set[str] = set()


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: NamedReplica

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status = 503 if self.path in self.server.refuse else 200
        body = json.dumps({"replica": self.server.name}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


def _balancer(tmp_path: Path, balance: str) -> Iterator[tuple[str, list[NamedReplica]]]:
    haproxy()
    replicas = [NamedReplica(f"r{slot}") for slot in range(1, REPLICAS + 1)]
    threads = [threading.Thread(target=r.serve_forever, daemon=True) for r in replicas]
    for thread in threads:
        thread.start()
    port = free_port()
    env = balancer_env("127.0.0.1", port, free_port(), tmp_path / "api.sock", balance, REPLICAS)
    process = start_balancer(CONFIG, env, tmp_path / "haproxy.log")
    try:
        api = RuntimeApi(tmp_path / "api.sock")
        for slot, replica in enumerate(replicas, start=1):
            # gRPC is not exercised here: the slot's gRPC server is the same HTTP server.
            api.place(slot, replica.server_address[1], replica.server_address[1])
            api.set_state(slot, "ready")
        for slot in range(1, REPLICAS + 1):
            api.wait_up(slot, timeout_s=10)
        yield f"http://127.0.0.1:{port}", replicas
    finally:
        stop_process(process.pid, 10)
        for replica in replicas:
            replica.shutdown()
            replica.server_close()


@pytest.fixture
def model_aware(tmp_path: Path) -> Iterator[tuple[str, list[NamedReplica]]]:
    yield from _balancer(tmp_path, "model")


@pytest.fixture
def round_robin(tmp_path: Path) -> Iterator[tuple[str, list[NamedReplica]]]:
    yield from _balancer(tmp_path, "roundrobin")


def _requests_naming(model: str) -> list[tuple[str, str, dict[str, object] | None, dict[str, str]]]:
    """(method, path, JSON body, headers): each way a client names ``model``."""
    return [
        ("POST", f"/v2/models/{model}/infer", {"inputs": []}, {}),
        ("POST", f"/v2/models/{model}/versions/1/infer", {"inputs": []}, {}),
        ("GET", f"/v2/models/{model}/ready", None, {}),
        ("POST", f"/v2/repository/models/{model}/load", {}, {}),
        ("POST", f"/predictions/{model}", {"data": 1}, {}),
        ("GET", f"/models/{model}", None, {}),
        ("GET", f"/v1/models/{model}", None, {}),
        ("POST", "/v1/embeddings", {"input": 'a text naming "model": x', "model": model}, {}),
        ("POST", "/v2/health/ready", None, {"x-nograd-model": model}),
    ]


def _replica(
    http: httpx.Client, method: str, path: str, body: object, headers: dict[str, str]
) -> str:
    answer = http.request(method, path, json=body, headers=headers)
    assert answer.status_code == 200, (path, answer.status_code, answer.text)
    return str(answer.json()["replica"])


def test_every_way_of_naming_a_model_reaches_its_replica(
    model_aware: tuple[str, list[NamedReplica]],
) -> None:
    url, _ = model_aware
    homes = {}
    with httpx.Client(base_url=url, timeout=10) as http:
        for model in MODELS:
            answered = {_replica(http, *request) for request in _requests_naming(model)}
            assert len(answered) == 1, (model, answered)
            homes[model] = answered.pop()
    assert set(homes.values()) == {f"r{slot}" for slot in range(1, REPLICAS + 1)}, homes


def test_a_503_is_answered_by_another_replica(
    model_aware: tuple[str, list[NamedReplica]],
) -> None:
    url, replicas = model_aware
    with httpx.Client(base_url=url, timeout=10) as http:
        path = f"/v2/models/{MODELS[0]}/infer"
        home = _replica(http, "POST", path, {}, {})
        (refusing,) = [replica for replica in replicas if replica.name == home]
        refusing.refuse.add(path)
        assert _replica(http, "POST", path, {}, {}) != home


def test_round_robin_ignores_the_model(round_robin: tuple[str, list[NamedReplica]]) -> None:
    url, _ = round_robin
    with httpx.Client(base_url=url, timeout=10) as http:
        answered = {
            _replica(http, "POST", f"/v2/models/{MODELS[0]}/infer", {}, {}) for _ in range(6)
        }
    assert answered == {f"r{slot}" for slot in range(1, REPLICAS + 1)}
