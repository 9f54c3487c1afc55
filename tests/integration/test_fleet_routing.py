"""HAProxy on deploy/fleet/haproxy.cfg, in front of three small HTTP servers that answer every
request with their own name: what is under test is the balancer's configuration, which replica
each kind of request goes to. Every way a client names a model (V2 path, TorchServe path,
OpenAI model path, the embeddings call's JSON body, the x-nograd-model header, the model control
path) sends that model to the same replica; different models spread over the replicas; a 503
is answered again by another replica; ``roundrobin`` ignores the model; every answer names the
replica that gave it, and the replicas' weights even the homes of a set of names the ring alone
splits unevenly (``nograd.fleet.homes``), and a replica added after that takes its share and
moves no other model. The balancer's own
bounds (docs/reliability.md) hold: a head larger than its buffer, a request slower than its
timeout, a replica slower than its answer timeout, an idle connection and connections past its
maximum."""

from __future__ import annotations

import json
import random
import socket
import string
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.phases.fleet import MODELS as BENCH_MODELS
from nograd.fleet.balancer import CONFIG, RuntimeApi, balancer_env, start_balancer
from nograd.fleet.homes import REPLICA_HEADER, WEIGHT, even_homes, homes, settle_new, spread
from nograd.fleet.replicas import stop_process
from tests.e2e.serving import free_port
from tests.prometheus_tools import haproxy

pytestmark = pytest.mark.integration

REPLICAS = 3
MODELS = [f"model-{index}" for index in range(12)]


class NamedReplica(ThreadingHTTPServer):
    """Answers ``{"replica": name}`` to everything, ready to health checks; 503 to the paths in
    ``refuse``; the paths in ``slow`` after that many seconds."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.name = name
        self.refuse: set[str] = set()
        self.slow: dict[str, float] = {}


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Its head and body go out in two writes: with Nagle's algorithm the body would wait for
    # the balancer's delayed acknowledgement of the head (40 ms a request).
    disable_nagle_algorithm = True
    server: NamedReplica

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        time.sleep(self.server.slow.get(self.path, 0.0))
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


def _balancer(
    tmp_path: Path, balance: str, bounds: dict[str, str] | None = None, spare: int = 0
) -> Iterator[tuple[str, list[NamedReplica]]]:
    """HAProxy on the shipped configuration before three named replicas; ``bounds`` sets its
    own limits' variables (``NOGRAD_FLEET_MAXCONN``...); ``spare`` more replicas are placed in
    the slots after them, in maintenance (out of the ring)."""
    haproxy()
    slots = REPLICAS + spare
    replicas = [NamedReplica(f"r{slot}") for slot in range(1, slots + 1)]
    # A short poll: shutdown() waits for serve_forever's next look at its stop flag.
    threads = [
        threading.Thread(target=r.serve_forever, args=(0.02,), daemon=True) for r in replicas
    ]
    for thread in threads:
        thread.start()
    port = free_port()
    env = balancer_env("127.0.0.1", port, free_port(), tmp_path / "api.sock", balance, slots)
    process = start_balancer(CONFIG, {**env, **(bounds or {})}, tmp_path / "haproxy.log")
    try:
        api = RuntimeApi(tmp_path / "api.sock")
        for slot, replica in enumerate(replicas, start=1):
            # gRPC is not exercised here: the slot's gRPC server is the same HTTP server.
            api.place(slot, replica.server_address[1], replica.server_address[1])
            if slot <= REPLICAS:
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
def with_a_spare(tmp_path: Path) -> Iterator[tuple[str, list[NamedReplica]]]:
    yield from _balancer(tmp_path, "model", spare=1)


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


def test_every_answer_names_the_replica_that_gave_it(
    model_aware: tuple[str, list[NamedReplica]],
) -> None:
    url, _ = model_aware
    with httpx.Client(base_url=url, timeout=10) as http:
        for model in MODELS:
            answer = http.post(f"/v2/models/{model}/infer", json={})
            # NamedReplica r<N> sits in HAProxy's slot replica<N>.
            assert answer.headers[REPLICA_HEADER] == "replica" + answer.json()["replica"][1:]


def _names(count: int, seed: int) -> list[str]:
    chooser = random.Random(seed)
    alphabet = string.ascii_lowercase + string.digits + "-_"
    return ["".join(chooser.choices(alphabet, k=chooser.randint(4, 14))) for _ in range(count)]


@pytest.mark.parametrize(
    "models",
    [[f"m{index}" for index in range(BENCH_MODELS)], _names(24, seed=1), _names(24, seed=2)],
    ids=["bench-models", "names-1", "names-2"],
)
def test_weights_even_the_homes_and_a_new_replica_takes_its_share(
    with_a_spare: tuple[str, list[NamedReplica]], tmp_path: Path, models: list[str]
) -> None:
    url, _ = with_a_spare
    api = RuntimeApi(tmp_path / "api.sock")
    three = list(range(1, REPLICAS + 1))
    for slot in three:
        api.set_weight(slot, WEIGHT)  # as `nograd fleet up` starts them
    drawn = spread(homes(url, models), three)
    evened = even_homes(api, url, models, three, allowed=1)
    counts = spread(evened, three)
    assert max(counts.values()) - min(counts.values()) <= 1, (drawn, counts)
    assert evened == homes(url, models)  # the weights hold the placement, not a cache

    # A fourth replica joins at the others' mean weight, and only its weight is stepped until it
    # is the home of its share: models move only onto it, a quarter of them give or take one.
    four = [*three, REPLICAS + 1]
    api.set_weight(REPLICAS + 1, round(sum(api.weight(slot) for slot in three) / REPLICAS))
    api.set_state(REPLICAS + 1, "ready")
    api.wait_up(REPLICAS + 1, timeout_s=10)
    scaled = settle_new(api, url, models, four, [REPLICAS + 1])
    assert scaled == homes(url, models)
    moved = {name for name in models if scaled[name] != evened[name]}
    assert {scaled[name] for name in moved} == {REPLICAS + 1}, (evened, scaled)
    assert abs(len(moved) - len(models) / len(four)) <= 1, sorted(moved)


SHORT_BOUNDS = {
    "NOGRAD_FLEET_HTTP_REQUEST_TIMEOUT": "1s",
    "NOGRAD_FLEET_SERVER_TIMEOUT": "1s",
    "NOGRAD_FLEET_KEEP_ALIVE_TIMEOUT": "1s",
}
"""The balancer's timeouts made short, so that a test reaches each in a second."""
FEW_CONNECTIONS = 4


@pytest.fixture
def bounded(tmp_path: Path) -> Iterator[tuple[str, list[NamedReplica]]]:
    yield from _balancer(tmp_path, "model", SHORT_BOUNDS)


@pytest.fixture
def few_connections(tmp_path: Path) -> Iterator[tuple[str, list[NamedReplica]]]:
    """At most ``FEW_CONNECTIONS`` client connections (its idle ones kept 10 s, as shipped)."""
    yield from _balancer(tmp_path, "model", {"NOGRAD_FLEET_MAXCONN": str(FEW_CONNECTIONS)})


def _raw_answer(port: int, sent: bytes, timeout_s: float) -> bytes:
    """What the balancer answers on a connection that sent ``sent`` and nothing more."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.sendall(sent)
        return conn.recv(4096)


def test_a_request_head_larger_than_the_buffer_is_a_400(
    model_aware: tuple[str, list[NamedReplica]],
) -> None:
    url, _ = model_aware
    with httpx.Client(base_url=url, timeout=10) as http:
        path = f"/v2/models/{MODELS[0]}/infer"
        answer = http.post(path, json={}, headers={"x-padding": "a" * 20_000})
        assert answer.status_code == 400
        assert _replica(http, "POST", path, {}, {}) in {f"r{n}" for n in range(1, REPLICAS + 1)}


def test_a_request_slower_than_its_timeout_is_a_408(
    bounded: tuple[str, list[NamedReplica]],
) -> None:
    url, _ = bounded
    port = int(url.rsplit(":", 1)[1])
    started = time.monotonic()
    head_only = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: fleet\r\n"
    assert _raw_answer(port, head_only, timeout_s=5).startswith(b"HTTP/1.1 408")
    # The body is held before a replica is chosen: a body that stops coming is a 408 too.
    part_of_a_body = (
        b"POST /v2/models/m/infer HTTP/1.1\r\nhost: fleet\r\ncontent-length: 100\r\n\r\n{"
    )
    assert _raw_answer(port, part_of_a_body, timeout_s=5).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < 8


def test_a_replica_slower_than_the_answer_timeout_is_a_504(
    bounded: tuple[str, list[NamedReplica]],
) -> None:
    url, replicas = bounded
    path = f"/v2/models/{MODELS[0]}/infer"
    for replica in replicas:
        replica.slow[path] = 3.0
    started = time.monotonic()
    answer = httpx.post(url + path, json={}, timeout=10)
    assert answer.status_code == 504
    assert time.monotonic() - started < 2.5


def test_connections_past_the_maximum_wait_until_one_closes(
    few_connections: tuple[str, list[NamedReplica]],
) -> None:
    url, _ = few_connections
    path = f"/v2/models/{MODELS[0]}/infer"
    held = [httpx.Client(base_url=url, timeout=5) for _ in range(FEW_CONNECTIONS)]
    try:
        for client in held:
            assert client.post(path, json={}).status_code == 200  # each keeps its connection
        with httpx.Client(base_url=url, timeout=1) as late, pytest.raises(httpx.TimeoutException):
            late.post(path, json={})
        held.pop().close()
        with httpx.Client(base_url=url, timeout=5) as late:
            assert late.post(path, json={}).status_code == 200
    finally:
        for client in held:
            client.close()


def test_an_idle_connection_is_closed_past_the_keep_alive_timeout(
    bounded: tuple[str, list[NamedReplica]],
) -> None:
    url, _ = bounded
    port = int(url.rsplit(":", 1)[1])
    request = b"GET /v2/models/m/ready HTTP/1.1\r\nhost: fleet\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert conn.recv(4096) == b""  # closed by the balancer, not by this client
        assert time.monotonic() - started < 4
