"""Memory over many reloads and unloads through a real server (explicit model control, two
workers): every worker's resident memory stays where it was after the first load, within 10% and
a small slack, where each load/unload cycle once kept the whole replaced version (minilm: about
290 MiB a cycle, until memory ran out in poll mode). The model holds 64 MiB in a reference cycle,
as real models hold theirs, so a single version kept is well outside the margin."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.serving import ROOT, Server, run_server

pytestmark = pytest.mark.e2e

HEAVY = ROOT / "tests" / "fixtures" / "models" / "heavy"
MODEL_MIB = 64
"""What one version of the model holds (``WEIGHT_BYTES`` in its model.py)."""
CYCLES = 10
GROWTH = 0.10
SLACK_MIB = 16.0
"""Beyond the 10%: a fixed allowance for what a worker's memory may move by between two loads of
the same version when nothing is kept (the C heap's and Python's arenas, the memory plan's probe
batches, metric and log buffers; measured: under 1 MiB over these cycles). A quarter of one
version, so one version kept (64 MiB against a ~400 MiB worker's 40 + 16) still fails."""
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}


@dataclass
class Served:
    server: Server
    client: httpx.Client
    code: Path
    """The model's code file: a new modification time makes the next load a reload."""

    def control(self, action: str) -> None:
        answer = self.client.post(f"/v2/repository/models/heavy/{action}")
        assert answer.status_code == 200, answer.text

    def infer(self) -> None:
        answer = self.client.post("/v2/models/heavy/infer", json=BODY)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [2.0]

    def workers(self) -> list[int]:
        """The workers' pids, from the supervisor's log."""
        started = re.findall(r"worker \d+ started \(pid (\d+)\)", self.server.log())
        return sorted({int(pid) for pid in started})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("repository")
    shutil.copytree(HEAVY, repo / "heavy")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_WORKERS": "2",
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": "heavy",
    }
    with (
        run_server(tmp_path_factory.mktemp("log"), env) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield Served(server, client, repo / "heavy" / "model.py")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def check_memory_stays(served: Served, cycle: Callable[[int], None], what: str) -> None:
    """Run ``cycle`` ``CYCLES`` times; each worker's memory after every one (the model loaded
    and answering) stays within the margin of its level before the first (after the start-up
    load, for the first test)."""
    pids = served.workers()
    assert len(pids) == 2, served.server.log()
    served.infer()
    before = {pid: rss_mib(pid) for pid in pids}
    for pid, mib in before.items():
        assert mib > 2 * MODEL_MIB, f"worker {pid}: {mib:.0f} MiB, not a worker holding the model"
    series: dict[int, list[int]] = {pid: [] for pid in pids}
    for index in range(CYCLES):
        cycle(index)
        served.infer()
        for pid in pids:
            series[pid].append(round(rss_mib(pid)))
    for pid in pids:
        ceiling = before[pid] * (1 + GROWTH) + SLACK_MIB
        assert max(series[pid]) <= ceiling, (
            f"worker {pid}: {before[pid]:.0f} MiB after the first load, then {series[pid]} MiB "
            f"after each {what} (at most {ceiling:.0f})"
        )


def test_reloading_a_model_ten_times_keeps_no_replaced_version(served: Served) -> None:
    def reload(index: int) -> None:
        # Changed code (a new modification time): the version is built again and replaces the
        # one serving.
        stamp = (index + 1) * 1_000_000_000
        os.utime(served.code, ns=(stamp, stamp))
        served.control("load")

    check_memory_stays(served, reload, "reload")
    assert served.server.log().count("unloaded (replaced by a newer load)") == 2 * CYCLES


def test_unloading_and_loading_a_model_ten_times_keeps_no_unloaded_version(
    served: Served,
) -> None:
    def unload_and_load(index: int) -> None:
        del index
        served.control("unload")
        served.control("load")

    check_memory_stays(served, unload_and_load, "unload and load")
