"""On-demand model control under a memory limit, through a real server: six models of 8 MiB of
weights each under a limit that holds three. Every request is answered 200 by the model it
asked for, loading it on its first request (once, however many requests wait), evicting the
least asked for; a model larger than the limit gets 507 naming the sizes; a model that fails
to load answers its error, without a load per request; the worker's memory stays bounded; the
files of an evicted model are kept in the page cache."""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nograd.host.page_cache import drop_cached
from tests.e2e.serving import Server, free_port, metric_value, run_server, worker_pids

pytestmark = pytest.mark.e2e

MODELS = 6
MODEL_MIB = 8
LIMIT_MIB = 28
"""Three models and their smallest batches, not four."""
EVICTION_ROUNDS = 20
"""Most rounds over the other models a test asks for before a model asked for more is evicted."""
HUGE_MIB = 40

CONFIG = """name = "{name}"
weights = ""
max_batch_size = 4
max_queue_delay_ms = 1
device = "cpu"

[[inputs]]
name = "x"
datatype = "FP32"
shape = [1]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [1]
"""

CODE = """import torch


class Table(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.full(({mib} << 18,), {value}.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        {forward}


def build(model_dir):
    return Table()
"""


def write_model(repo: Path, name: str, mib: int, value: int, broken: bool = False) -> None:
    folder = repo / name
    folder.mkdir()
    (folder / "config.toml").write_text(CONFIG.format(name=name))
    forward = "return x + self.table[0]"
    code = CODE.format(mib=mib, value=value, forward=forward)
    if broken:
        code = code.replace(
            "def build(model_dir):", "def build(model_dir):\n    raise OSError('no weights here')"
        )
    (folder / "model.py").write_text(code)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repository")
    for index in range(MODELS):
        write_model(repo, f"m{index}", MODEL_MIB, index)
    write_model(repo, "huge", HUGE_MIB, 7)
    write_model(repo, "broken", 1, 0, broken=True)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repository),
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": f"{LIMIT_MIB}MiB",
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    with run_server(tmp_path_factory.mktemp("log"), env) as running:
        yield running


def infer(client: httpx.Client, name: str, x: float = 1.0) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}
    return client.post(f"/v2/models/{name}/infer", json=body)


def answer_of(client: httpx.Client, index: int) -> None:
    answer = infer(client, f"m{index}", 0.5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model_name"] == f"m{index}"
    assert answer.json()["outputs"][0]["data"] == [index + 0.5]


@pytest.fixture(scope="module")
def fronts_server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same server as one engine process and two fronts."""
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repository),
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": f"{LIMIT_MIB}MiB",
        "NOGRAD_FRONTS": "2",
    }
    with run_server(tmp_path_factory.mktemp("log"), env) as running:
        yield running


def rss_mib(server: Server) -> float:
    engine = re.findall(r"engine started \(pid (\d+)\)", server.log())
    pid = int(engine[-1]) if engine else worker_pids(server).get(0, server.process.pid)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def index_of(client: httpx.Client) -> dict[str, dict[str, str]]:
    answer = client.post("/v2/repository/index", json={})
    assert answer.status_code == 200, answer.text
    return {row["name"]: row for row in answer.json()}


def test_models_load_on_first_request_and_evict_by_memory(server: Server) -> None:
    loads_and_evicts_within_the_limit(server)


def test_with_fronts_the_limit_holds_each_model_once_for_the_whole_server(
    fronts_server: Server,
) -> None:
    """Requests through either front reach the one engine: the limit is the whole server's,
    not divided by the fronts, and a model is loaded once however many fronts ask for it."""
    loads_and_evicts_within_the_limit(fronts_server)


def loads_and_evicts_within_the_limit(server: Server) -> None:
    url = server.url
    with httpx.Client(base_url=url, timeout=60) as client:
        listed = index_of(client)
        assert set(listed) >= {f"m{i}" for i in range(MODELS)}
        assert all(row["state"] == "UNAVAILABLE" for row in listed.values()), listed
        assert "loads on its first request" in listed["m0"]["reason"]

        # Eight requests for one cold model: one load, every one answered by it.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: answer_of(client, 0), range(8)))
        assert metric_value(url, "nograd_model_loads_total", model="m0") == 1
        # The first load brings what every later one shares (libraries, threads, the plan's
        # probes): memory is compared from there, one model resident.
        first_mib = rss_mib(server)

        # Two rounds over six models, from three clients at once: every answer right.
        order = [i % MODELS for i in range(2 * MODELS)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda i: answer_of(client, i), order))
        after_rounds_mib, after_rounds_held = rss_mib(server), held_mib(url)
        for index in range(MODELS):  # and once more one at a time: each load evicts a model
            answer_of(client, index)

        listed = index_of(client)
        ready = [name for name, row in listed.items() if row["state"] == "READY"]
        assert 1 <= len(ready) <= 3, listed
        evicted = [row for row in listed.values() if "evicted" in row.get("reason", "")]
        assert evicted, listed
        assert metric_value(url, "nograd_model_loads_total") >= MODELS + 3
        assert metric_value(url, "nograd_model_evictions_total", reason="memory") >= MODELS
        assert metric_value(url, "nograd_models_resident") == len(ready)
        held = metric_value(url, "nograd_model_resident_bytes")
        assert MODEL_MIB << 20 <= held <= LIMIT_MIB << 20
        assert metric_value(url, "nograd_model_load_duration_seconds_count") >= MODELS + 3
        end_mib, end_held = rss_mib(server), held / (1 << 20)
    # Memory returned at eviction: within the limit above one resident model (and half of it
    # again for the heap), and no growth with the number of loads after the first rounds besides
    # what the models resident at each reading hold (one to three of them: 8 MiB apart).
    assert end_mib - first_mib <= 1.5 * LIMIT_MIB, (first_mib, after_rounds_mib, end_mib)
    grown = (end_mib - end_held) - (after_rounds_mib - after_rounds_held)
    assert grown <= MODEL_MIB, (after_rounds_mib, after_rounds_held, end_mib, end_held)


def held_mib(url: str) -> float:
    """What the resident models hold, as the server counts it."""
    return metric_value(url, "nograd_model_resident_bytes") / (1 << 20)


def cached_fraction(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` on a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with path.open("rb") as file:
        mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    start = ctypes.c_char.from_buffer(mapping)
    address = ctypes.c_void_p(ctypes.addressof(start))
    failed = libc.mincore(address, ctypes.c_size_t(size), vector)
    del start
    mapping.close()
    assert failed == 0, os.strerror(ctypes.get_errno())
    return sum(page & 1 for page in vector) / pages


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_an_evicted_models_files_are_kept_in_the_page_cache(
    server: Server, repository: Path
) -> None:
    files = [path for path in (repository / "m0").rglob("*") if path.is_file()]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answer_of(client, 0)  # resident, and the most recently used
        drop_cached(files)
        assert min(cached_fraction(path) for path in files) < 1.0
        evictions = metric_value(server.url, "nograd_model_evictions_total", model="m0")
        # More than the limit holds, asked for until m0 is the least asked for (the tests
        # before asked for it too) and goes.
        for _ in range(EVICTION_ROUNDS):
            for index in range(1, MODELS):
                answer_of(client, index)
            if metric_value(server.url, "nograd_model_evictions_total", model="m0") > evictions:
                break
        assert metric_value(server.url, "nograd_model_evictions_total", model="m0") > evictions
    deadline = time.monotonic() + 10  # the kernel reads them back asynchronously
    while min(cached_fraction(path) for path in files) < 1.0:
        assert time.monotonic() < deadline, [(path, cached_fraction(path)) for path in files]
        time.sleep(0.1)


def test_a_model_larger_than_the_limit_is_refused_with_507(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(2):  # the first load measures it; the second is refused before loading
            answer = infer(client, "huge")
            assert answer.status_code == 507, answer.text
            assert f"limit of {LIMIT_MIB}.0 MiB" in answer.text
            assert "NOGRAD_MEMORY_LIMIT_BYTES" in answer.text
        assert metric_value(server.url, "nograd_model_loads_total", model="huge") == 1
        answer_of(client, 1)  # the others still serve


def test_a_failed_load_answers_its_waiters_and_is_not_retried(server: Server) -> None:
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        answers = list(pool.map(lambda _: infer(client, "broken"), range(4)))
        answers.append(infer(client, "broken"))
        for answer in answers:
            assert answer.status_code == 400, answer.text
            assert "no weights here" in answer.text
        assert index_of(client)["broken"]["state"] == "UNAVAILABLE"
        assert "no weights here" in index_of(client)["broken"]["reason"]
    assert server.log().count("OSError: no weights here") <= 2  # one load (its trace, its log)


def grpc_answer_of(address: str, index: int) -> None:
    import numpy as np
    import tritonclient.grpc as triton

    grpc_client = triton.InferenceServerClient(address)
    try:
        tensor = triton.InferInput("x", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[0.25]], dtype=np.float32))
        result = grpc_client.infer(f"m{index}", [tensor]).as_numpy("y")
        assert result is not None and result.tolist() == [[index + 0.25]]
    finally:
        grpc_client.close()


def test_grpc_requests_load_models_too(server: Server) -> None:
    assert server.grpc_address is not None
    for index in (4, 5, 0, 1, 2):
        grpc_answer_of(server.grpc_address, index)


def placement_of(client: httpx.Client) -> tuple[dict[str, int], dict[str, dict[str, object]]]:
    answer = client.get("/nograd/placement")
    assert answer.status_code == 200, answer.text
    document = answer.json()
    return document["memory"], {row["name"]: row for row in document["models"]}


def test_placement_and_metrics_show_a_model_loaded_on_demand_then_evicted(
    server: Server,
) -> None:
    url = server.url
    with httpx.Client(base_url=url, timeout=60) as client:
        answer_of(client, 5)
        memory, models = agreed_placement(client)
        assert set(models) >= {f"m{i}" for i in range(MODELS)} | {"huge", "broken"}
        held = models["m5"]
        assert held["state"] == "resident", held
        assert MODEL_MIB << 20 <= int(str(held["bytes"])) <= LIMIT_MIB << 20, held
        assert (held["queue_depth"], held["in_flight"], held["pinned"]) == (0, 0, False)
        resident = [row for row in models.values() if row["state"] == "resident"]
        assert memory["limit_bytes"] == LIMIT_MIB << 20
        assert memory["used_bytes"] == sum(int(str(row["bytes"])) for row in resident)
        assert memory["free_bytes"] == max(0, memory["limit_bytes"] - memory["used_bytes"])
        assert metric_value(url, "nograd_model_resident_bytes", model="m5") == held["bytes"]
        assert metric_value(url, "nograd_memory_limit_bytes") == LIMIT_MIB << 20
        assert metric_value(url, "nograd_model_inflight_requests", model="m5") == 0

        # More than the limit holds, until m5 is the least asked for and goes.
        for _ in range(EVICTION_ROUNDS):
            for index in range(MODELS - 1):
                answer_of(client, index)
            if placement_of(client)[1]["m5"]["state"] == "not_resident":
                break
        memory, models = agreed_placement(client)
        assert (models["m5"]["state"], models["m5"]["bytes"]) == ("not_resident", 0)
        assert metric_value(url, "nograd_model_resident_bytes", model="m5") == 0
        assert metric_value(url, "nograd_model_loading", model="m5") == 0
        assert memory["used_bytes"] <= LIMIT_MIB << 20


def agreed_placement(client: httpx.Client) -> tuple[dict[str, int], dict[str, dict[str, object]]]:
    """The placement once the metrics say the same room is free: a model answering on an
    estimate of its memory is profiled at the first quiet moment, which may resize it between
    two reads (a bounded number of tries)."""
    for _ in range(50):
        memory, models = placement_of(client)
        free = metric_value(str(client.base_url), "nograd_memory_free_bytes")
        if free == memory["free_bytes"] and placement_of(client)[0] == memory:
            return memory, models
        time.sleep(0.1)
    raise AssertionError(f"the metrics never showed the placement's free room: {memory}, {free}")


@pytest.mark.slow
def test_two_workers_each_keep_their_part_and_grpc_loads_too(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two workers, each within half the limit (two models); one model pinned by its config;
    requests over HTTP and gRPC for models none has loaded are answered by them."""
    repo = tmp_path_factory.mktemp("repository")
    for index in range(4):
        write_model(repo, f"m{index}", MODEL_MIB, index)
    config = repo / "m3" / "config.toml"
    config.write_text(
        config.read_text().replace('weights = ""', 'weights = ""\nresident = "always"')
    )
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_MEMORY_LIMIT_BYTES": f"{2 * LIMIT_MIB - 2 * MODEL_MIB}MiB",
        "NOGRAD_WORKERS": "2",
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    with (
        run_server(tmp_path_factory.mktemp("log"), env) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        listed = index_of(client)
        assert listed["m3"]["state"] == "READY" and listed["m0"]["state"] == "UNAVAILABLE"
        assert running.grpc_address is not None
        for index in range(4):
            answer_of(client, index)
            grpc_answer_of(running.grpc_address, index)
        assert metric_value(running.url, "nograd_model_evictions_total", model="m3") == 0
        # Each worker holds the pinned model and at most one other (20 MiB each).
        assert metric_value(running.url, "nograd_models_resident") <= 4
        assert metric_value(running.url, "nograd_model_evictions_total", reason="memory") >= 1
        # Whichever worker answers, the placement is the whole server's, as /metrics is. A
        # model measured in the background meanwhile changes what both say: compared once two
        # reads in a row agree (a profile lands within seconds of a worker's quiet moment).
        limit = (2 * LIMIT_MIB - 2 * MODEL_MIB) << 20
        deadline = time.monotonic() + 30
        while True:
            memory, models = placement_of(client)
            free = metric_value(running.url, "nograd_memory_free_bytes")
            held = metric_value(running.url, "nograd_model_resident_bytes", model="m3")
            if (memory["free_bytes"], models["m3"]["bytes"]) == (free, held):
                break
            assert time.monotonic() < deadline, (memory, free, models["m3"], held)
            time.sleep(0.5)
        assert (
            memory["limit_bytes"] == limit == metric_value(running.url, "nograd_memory_limit_bytes")
        )
        assert models["m3"]["pinned"] and models["m3"]["resident_workers"] == 2, models["m3"]
        assert models["m3"]["bytes"] == held > 0
