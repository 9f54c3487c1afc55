"""A real fleet on one machine: ``nograd fleet up`` starts two replicas (on-demand control, a
repository of small ONNX models whose answer is their index) behind Debian's HAProxy running
deploy/fleet/haproxy.cfg. Each model's requests, HTTP and gRPC, land on one replica, the one
that holds it; ``rolling-restart`` and ``scale`` under a steady light load fail no request;
a scale moves models only onto the new replica; ``down`` leaves no process.

The tests share one fleet and run in order (each leaves it as the next expects)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.residency_models import ROWS, onnx_repository
from nograd.fleet.state import Fleet, alive, load, state_path
from tests.e2e.serving import ROOT, free_port
from tests.prometheus_tools import haproxy

pytestmark = pytest.mark.e2e

MODELS = 8
BODY = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, ROWS], "data": [0.0] * ROWS}]}
"""A zero row: each model answers its own index."""
FLEET = (sys.executable, "-m", "nograd", "fleet")


@dataclass
class FleetUnderTest:
    port: int
    state_dir: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, *args: str, timeout_s: float = 180) -> str:
        """``nograd fleet ARGS --port P --state-dir D``, which must succeed; its output."""
        done = subprocess.run(
            [*FLEET, *args, "--port", str(self.port), "--state-dir", str(self.state_dir)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"nograd fleet {args}: {done.stdout}{done.stderr}"
        return done.stdout

    def state(self) -> Fleet:
        return load(state_path(self.state_dir, self.port))


def _free_port_pair() -> int:
    """A port P with P + 1 free too (the balancer's HTTP and gRPC ports)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetUnderTest]:
    haproxy()
    root = tmp_path_factory.mktemp("fleet")
    repo = onnx_repository(root, models=MODELS, weights_mib=1)
    env = {
        **os.environ,
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": "64MiB",
        "NOGRAD_WORKERS": "1",
        "NOGRAD_LOG_LEVEL": "warning",
    }
    under_test = FleetUnderTest(_free_port_pair(), root / "state", env)
    under_test.run("up", "--replicas", "2")
    try:
        yield under_test
    finally:
        if state_path(under_test.state_dir, under_test.port).is_file():
            under_test.run("down")


def requests_by_replica(fleet: Fleet) -> dict[int, Counter[str]]:
    """Each replica's answered requests per model (its ``nograd_requests_total``), one scrape
    per replica."""
    counts: dict[int, Counter[str]] = {}
    for replica in fleet.replicas:
        text = httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text
        counts[replica.slot] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "nograd_requests_total" and "model" in sample.labels:
                    counts[replica.slot][sample.labels["model"]] += int(sample.value)
    return counts


def _loads(fleet: Fleet) -> float:
    """Cold loads over the replicas (their ``nograd_model_loads_total``)."""
    total = 0.0
    for replica in fleet.replicas:
        text = httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == "nograd_model_loads_total")
    return total


def homes(under_test: FleetUnderTest, asked: int = 2) -> dict[str, int]:
    """Ask each model ``asked`` times through the balancer, one request at a time; the slot of
    the replica that answered all of them (every answer from the model asked)."""
    before = requests_by_replica(under_test.state())
    with httpx.Client(base_url=under_test.url, timeout=60) as http:
        for index in range(MODELS):
            for _ in range(asked):
                answer = http.post(f"/v2/models/m{index}/infer", json=BODY)
                assert answer.status_code == 200, answer.text
                assert answer.json()["outputs"][0]["data"] == [float(index)]
    after = requests_by_replica(under_test.state())
    found = {}
    for index in range(MODELS):
        name = f"m{index}"
        answered = {slot: after[slot][name] - before[slot][name] for slot in after}
        (slot,) = [slot for slot, count in answered.items() if count]
        assert answered[slot] == asked, answered
        found[name] = slot
    return found


@dataclass
class Load:
    """Clients asking every model in turn, a request at a time with a short pause, until
    stopped; every answer is checked."""

    url: str
    clients: int = 2
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._client, args=(n,)) for n in range(2)]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _client(self, number: int) -> None:
        index = number
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                name = f"m{index % MODELS}"
                try:
                    answer = http.post(f"/v2/models/{name}/infer", json=BODY)
                    data = (
                        answer.json()["outputs"][0]["data"] if answer.status_code == 200 else None
                    )
                    if data != [float(index % MODELS)]:
                        self.failures.append(f"{name}: {answer.status_code} {answer.text[:200]}")
                    else:
                        self.answered += 1
                except httpx.HTTPError as exc:
                    self.failures.append(f"{name}: {type(exc).__name__} {exc}")
                index += 1
                time.sleep(0.02)


def test_each_model_lands_on_the_replica_that_holds_it(fleet: FleetUnderTest) -> None:
    # `nograd fleet homes` finds each model's home without loading it (the fleet is fresh)...
    listed = fleet.run("homes").splitlines()
    assert _loads(fleet.state()) == 0
    found = homes(fleet)
    # ... and the requests go there; `up` evened the homes: as many models on each replica.
    assert {f"{name} replica{slot}" for name, slot in found.items()} <= set(listed), listed
    assert Counter(found.values()) == {1: MODELS // 2, 2: MODELS // 2}, found
    # The placement route says the same: each replica holds exactly the models sent to it.
    for replica in fleet.state().replicas:
        placement = httpx.get(f"http://127.0.0.1:{replica.http_port}/nograd/placement").json()
        resident = {row["name"] for row in placement["models"] if row["state"] == "resident"}
        assert resident == {name for name, slot in found.items() if slot == replica.slot}

    # gRPC routes by the x-nograd-model header to the same replica.
    before = requests_by_replica(fleet.state())
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{fleet.port + 1}")
    for index in range(MODELS):
        row = triton_grpc.InferInput("X", [1, ROWS], "FP32")
        row.set_data_from_numpy(np.zeros((1, ROWS), np.float32))
        answer = client.infer(f"m{index}", [row], headers={"x-nograd-model": f"m{index}"})
        assert answer.as_numpy("Y").tolist() == [[float(index)]]
    client.close()
    after = requests_by_replica(fleet.state())
    for name, slot in found.items():
        assert {s: after[s][name] - before[s][name] for s in after} == {
            s: int(s == slot) for s in after
        }


def test_rolling_restart_under_load_fails_no_request(fleet: FleetUnderTest) -> None:
    before = {replica.slot: replica.pid for replica in fleet.state().replicas}
    with Load(fleet.url) as load_:
        fleet.run("rolling-restart")
        answered_during = load_.answered
        time.sleep(0.5)
    assert not load_.failures, load_.failures[:5]
    assert answered_during > 0
    after = {replica.slot: replica.pid for replica in fleet.state().replicas}
    assert after.keys() == before.keys()
    assert all(after[slot] != before[slot] and alive(after[slot]) for slot in after)
    assert not any(alive(pid) for pid in before.values())


def test_scale_up_moves_models_only_onto_the_new_replica(fleet: FleetUnderTest) -> None:
    found = homes(fleet)
    with Load(fleet.url) as load_:
        fleet.run("scale", "--replicas", "3")
    assert not load_.failures, load_.failures[:5]
    assert [replica.slot for replica in fleet.state().replicas] == [1, 2, 3]
    moved = {name: slot for name, slot in homes(fleet).items() if slot != found[name]}
    assert moved, "no model moved to the new replica"
    assert set(moved.values()) == {3}, (found, moved)

    with Load(fleet.url) as load_:
        fleet.run("scale", "--replicas", "2")
    assert not load_.failures, load_.failures[:5]
    assert homes(fleet) == found


def test_down_leaves_no_process(fleet: FleetUnderTest) -> None:
    state = fleet.state()
    pids = [state.balancer_pid, *(replica.pid for replica in state.replicas)]
    fleet.run("down")
    assert not [pid for pid in pids if alive(pid)]
    assert not state_path(fleet.state_dir, fleet.port).exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{fleet.url}/v2/health/ready", timeout=2)
