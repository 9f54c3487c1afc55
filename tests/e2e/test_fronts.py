"""One engine process and front processes (NOGRAD_FRONTS): only the engine maps libtorch, the
HTTP connections spread over the fronts, answers come back as a single server gives them (V2
JSON and binary, gRPC, metrics, statistics, Triton's trace file), a sequence whose requests
each arrive on a fresh connection accumulates as on one, a dead front or engine is started
again and, while the engine is away, every call gets 503 at once."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from nograd.host.cpu_batches import planned_cpu_batches
from nograd.host.readings import gpu_visible, usable_cores
from nograd.supervisor.plan import auto_fronts
from tests.e2e.serving import ROOT, Server, free_port, metric_value, run_server, wait_for_log
from tests.e2e.test_triton_sequences import CONFIG, accumulator

pytestmark = pytest.mark.e2e
DIGITS = {
    "inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [4.0] * 64}]
}
FRONTS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fronts")
    repo = root / "repo"
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    accumulator(repo / "accumulator" / "1" / "model.onnx")
    config = CONFIG.format(name="accumulator", idle_us=30_000_000, delay_us=0)
    (repo / "accumulator" / "config.pbtxt").write_text(config)
    env = {
        "NOGRAD_FRONTS": str(FRONTS),
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_LOG_FORMAT": "text",
        "NOGRAD_TRACE_FILE": str(root / "trace.json"),
    }
    with run_server(root, env) as running:
        yield running


def pids(server: Server) -> dict[str, int]:
    """``engine``, ``front 1`` … -> the pid of its latest start, from the supervisor's log."""
    started = re.findall(r"(engine|front \d+) started \(pid (\d+)\)", server.log())
    return {name: int(pid) for name, pid in started}


def maps_libtorch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def connections(pid: int, port: int) -> set[str]:
    """The inodes of the TCP connections ``pid`` holds on ``port`` (/proc/net/tcp, established)."""
    on_port = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                on_port.add(fields[9])
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except FileNotFoundError:
            continue
        if link.startswith("socket:[") and link[8:-1] in on_port:
            held.add(link[8:-1])
    return held


def test_only_the_engine_loads_torch_and_the_fronts_hold_the_connections(
    server: Server,
) -> None:
    log = server.log()
    assert f"with one engine process and {FRONTS} front processes" in log
    # The engine runs its CPU batches side by side, as many as workers would have been.
    batches = planned_cpu_batches("auto", True, True, usable_cores())
    assert f"{batches} CPU batch{'es' if batches > 1 else ''} at once" in log
    started = pids(server)
    assert sorted(started) == ["engine", "front 1", "front 2"]
    assert maps_libtorch(started["engine"])
    assert not maps_libtorch(server.process.pid)
    assert not any(maps_libtorch(started[f"front {i}"]) for i in (1, 2))
    # The fronts run below the engine's priority (NOGRAD_FRONT_NICE, 5 by default).
    engine_nice = nice_of(started["engine"])
    assert [nice_of(started[f"front {i}"]) - engine_nice for i in (1, 2)] == [5, 5]
    port = httpx.URL(server.url).port
    assert port is not None
    before = {i: connections(started[f"front {i}"], port) for i in (1, 2)}
    clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(32)]
    try:
        for client in clients:
            assert client.post("/v2/models/digits/infer", json=DIGITS).status_code == 200
        gained = {i: len(connections(started[f"front {i}"], port) - before[i]) for i in (1, 2)}
    finally:
        for client in clients:
            client.close()
    # Counted as connections new since `before`, so one closing meanwhile (the readiness poll's)
    # takes nothing off. Each new connection goes to the front with the fewest open; under a busy
    # machine a front's count may lag a hand-off or two, never the whole load.
    assert sum(gained.values()) == 32 and min(gained.values()) >= 8, gained


def test_the_defaults_start_the_engine_and_fronts_auto_plans(tmp_path: Path) -> None:
    """``make run`` as shipped (``NOGRAD_WORKERS`` and ``NOGRAD_FRONTS`` unset): on 2 usable
    cores or more, one engine process maps libtorch and the fronts ``auto`` plans serve."""
    cores, gpu = usable_cores(), gpu_visible()
    expected, reason = auto_fronts(cores, gpu, on_demand=False)
    if not expected:
        pytest.skip(f"{cores} usable core: auto plans one process")
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    env = {
        "NOGRAD_WORKERS": "auto",
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_LOG_FORMAT": "text",
    }
    with run_server(tmp_path, env) as server:
        log = server.log()
        assert f"fronts: auto, one engine process and {expected} fronts ({reason})" in log
        started = pids(server)
        assert sorted(started) == ["engine", *(f"front {i}" for i in range(1, expected + 1))]
        assert [name for name, pid in started.items() if maps_libtorch(pid)] == ["engine"]
        answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=DIGITS, timeout=30)
        assert answer.status_code == 200, answer.text


def nice_of(pid: int) -> int:
    """A process's nice value (/proc/PID/stat, the 19th field; the name before may hold spaces)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


def binary_digits() -> tuple[bytes, dict[str, str]]:
    header = {
        "inputs": [
            {
                "name": "image",
                "shape": [1, 1, 8, 8],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 256},
            }
        ],
        "outputs": [{"name": "label", "parameters": {"binary_data": True}}],
    }
    raw = orjson.dumps(header)
    data = np.linspace(0, 16, 64, dtype=np.float32).tobytes()
    return raw + data, {"Inference-Header-Content-Length": str(len(raw))}


def calls() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    digits = orjson.dumps(DIGITS)
    wide = {"inputs": [{**DIGITS["inputs"][0], "shape": [1, 1, 8, 9], "data": [1.0] * 72}]}
    with_id = {**DIGITS, "id": "q7", "outputs": [{"name": "probabilities"}]}
    return {
        "json": ("digits", digits, {}),
        "binary": ("digits", *binary_digits()),
        "compressed": ("digits", digits, {"Accept-Encoding": "gzip"}),
        "id-and-outputs": ("digits", orjson.dumps(with_id), {}),
        "wrong-shape": ("digits", orjson.dumps(wide), {}),
        "unknown-model": ("nope", digits, {}),
    }


@pytest.mark.parametrize("case", list(calls()))
def test_a_call_decoded_by_its_front_is_answered_as_one_the_engine_decodes(
    server: Server, case: str
) -> None:
    """A request with its length is decoded by the front; the same request chunked reaches the
    engine as it came: both get the same status, headers and bytes."""
    model, body, headers = calls()[case]
    headers = {**headers, "X-Request-ID": f"same-{case}"}
    url = f"{server.url}/v2/models/{model}/infer"
    with httpx.Client(timeout=30) as client:
        decoded = client.post(url, content=body, headers=headers)
        as_sent = client.post(url, content=iter([body]), headers=headers)
    assert "content-length" not in as_sent.request.headers  # chunked: not decoded by the front
    assert decoded.status_code == as_sent.status_code
    assert decoded.content == as_sent.content
    skip = {b"date"}  # raw header names are bytes
    assert [h for h in decoded.headers.raw if h[0] not in skip] == [
        h for h in as_sent.headers.raw if h[0] not in skip
    ]


def test_answers_come_back_as_a_single_server_gives_them(server: Server) -> None:
    answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=DIGITS, timeout=30)
    assert answer.status_code == 200
    assert [o["name"] for o in answer.json()["outputs"]] == ["logits", "probabilities", "label"]
    missing = httpx.get(f"{server.url}/v2/models/nope", timeout=30)
    assert missing.status_code == 404
    assert missing.json() == {"error": "Request for unknown model: 'nope' is not found"}
    # Binary tensors (Triton's extension) over HTTP, and gRPC, which the engine serves itself.
    host = server.url.removeprefix("http://")
    assert server.grpc_address is not None
    for client, module in (
        (triton_http.InferenceServerClient(host), triton_http),
        (triton_grpc.InferenceServerClient(server.grpc_address), triton_grpc),
    ):
        image = module.InferInput("image", [1, 1, 8, 8], "FP32")
        image.set_data_from_numpy(np.full((1, 1, 8, 8), 4.0, np.float32))
        got = client.infer("digits", [image]).as_numpy("logits")
        assert got is not None and np.allclose(got, answer.json()["outputs"][0]["data"])
    assert metric_value(server.url, "nograd_requests_total", model="digits") >= 3
    stats = httpx.get(f"{server.url}/v2/models/digits/stats", timeout=30).json()
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 3


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sequence_on_fresh_connections_accumulates_as_on_one(
    server: Server, protocol: str
) -> None:
    sequence = 41 if protocol == "http" else 42
    sums = []
    for step, value in enumerate((1, 2, 3, 4)):
        # A new client each time: a new connection, handed to either front.
        if protocol == "http":
            client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
            module = triton_http
        else:
            assert server.grpc_address is not None
            client = triton_grpc.InferenceServerClient(server.grpc_address)
            module = triton_grpc
        tensor = module.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], np.int32))
        result = client.infer(
            "accumulator", [tensor], sequence_id=sequence, sequence_start=step == 0
        )
        sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
        client.close()
    assert sums == [1, 3, 6, 10]


def test_a_sampled_call_goes_to_triton_s_trace_file_by_its_name(server: Server) -> None:
    """The engine alone holds the trace settings and writes the traces: Triton's file name, as
    one process writes it, with no per-process suffix (that is for several workers)."""
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    sampled = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1"}
    http.update_trace_settings(settings=sampled)
    folder = Path(server.log_path).parent
    written = folder / "trace.json.0"
    try:
        answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=DIGITS, timeout=30)
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 10
        while not written.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = orjson.loads(written.read_bytes())
    finally:
        off = ("trace_level", "trace_rate", "trace_count", "log_frequency")
        http.update_trace_settings(settings=dict.fromkeys(off))
    assert [e["model_name"] for e in entries if "model_name" in e] == ["digits"]
    assert sorted(p.name for p in folder.glob("trace.json*")) == ["trace.json.0"]


def test_a_front_that_dies_is_started_again(server: Server) -> None:
    front = pids(server)["front 1"]
    os.kill(front, signal.SIGKILL)
    wait_for_log(server, "front 1 started", times=2, timeout_s=30)
    wait_for_log(server, "front 1 ready after", times=2, timeout_s=30)
    assert pids(server)["front 1"] != front
    for _ in range(4):  # new connections reach both fronts again
        answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=DIGITS, timeout=30)
        assert answer.status_code == 200


def test_an_engine_that_dies_is_a_503_at_once_then_back(server: Server) -> None:
    started = pids(server)
    os.kill(started["engine"], signal.SIGKILL)
    # While it is away every call is answered at once, never left waiting.
    refused = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and refused < 5:
        sent = time.monotonic()
        answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=DIGITS, timeout=30)
        assert time.monotonic() - sent < 3
        if answer.status_code == 503:
            refused += 1
            assert answer.headers["retry-after"] == "1"
            assert "engine process is not reachable" in answer.json()["error"]
    assert refused == 5, server.log()
    wait_for_log(server, "engine ready after", times=2, timeout_s=120)
    deadline = time.monotonic() + 10
    while True:
        answer = httpx.post(f"{server.url}/v2/models/digits/infer", json=DIGITS, timeout=30)
        if answer.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.status_code == 200, server.log()
    # The fronts kept running: only the engine was started again.
    assert {k: v for k, v in pids(server).items() if k != "engine"} == {
        k: v for k, v in started.items() if k != "engine"
    }
