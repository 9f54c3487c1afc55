"""Statistics extension counters (``nograd/observability/stats.py``), driven directly and through a
real batcher."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import pytest

from nograd.batching import Batcher, BatchLimit
from nograd.observability.stats import FanOutObserver, ModelStatistics, Statistics


def test_empty_model_has_triton_shape_and_zeros() -> None:
    document = ModelStatistics().document("m", "1")
    assert document["name"] == "m" and document["version"] == "1"
    assert document["inference_count"] == document["execution_count"] == 0
    assert document["last_inference"] == 0
    assert set(document["inference_stats"]) == {
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "cache_hit",
        "cache_miss",
    }
    assert all(v == {"count": 0, "ns": 0} for v in document["inference_stats"].values())
    assert document["batch_stats"] == []


def test_requests_and_batches_accumulate() -> None:
    stats = ModelStatistics()
    stats.request_succeeded(rows=3, seconds=0.5)
    stats.request_failed(seconds=0.25)
    stats.batch_started([0.001, 0.002])
    stats.batch_finished(rows=3, seconds=0.01, ok=True)
    stats.batch_started([0.004])
    stats.batch_finished(rows=1, seconds=0.02, ok=False)  # failed batch: no execution
    document = stats.document("m", "1")
    inference = document["inference_stats"]
    assert inference["success"] == {"count": 1, "ns": 500_000_000}
    assert inference["fail"] == {"count": 1, "ns": 250_000_000}
    assert inference["queue"] == {"count": 3, "ns": 7_000_000}
    # Two requests shared the 10 ms batch: each is charged its whole duration.
    assert inference["compute_infer"] == {"count": 2, "ns": 20_000_000}
    assert inference["compute_input"] == {"count": 2, "ns": 0}
    assert document["inference_count"] == 3
    assert document["execution_count"] == 1
    assert document["last_inference"] > 0
    assert document["batch_stats"] == [
        {
            "batch_size": 3,
            "compute_input": {"count": 1, "ns": 0},
            "compute_infer": {"count": 1, "ns": 10_000_000},
            "compute_output": {"count": 1, "ns": 0},
        }
    ]


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "file"])
def test_counters_are_exact_under_concurrent_updates(shared: bool, tmp_path: Path) -> None:
    stats = ModelStatistics((tmp_path, "v2stats_6d") if shared else None)

    def hammer() -> None:
        for _ in range(2000):
            stats.request_succeeded(1, 0.001)
            stats.batch_started([0.001])
            stats.batch_finished(1, 0.001, True)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    document = stats.document("m", "1")
    assert document["inference_count"] == 8000
    assert document["execution_count"] == 8000
    assert document["inference_stats"]["queue"]["count"] == 8000
    assert document["batch_stats"][0]["compute_infer"]["count"] == 8000


def test_statistics_creates_each_model_once() -> None:
    statistics = Statistics()
    assert statistics.of("a") is statistics.of("a")
    assert statistics.of("a") is not statistics.of("b")


def _as_process(monkeypatch: pytest.MonkeyPatch, pid: int, shared: Path) -> Statistics:
    """The statistics of one worker process of a server sharing ``shared``."""
    monkeypatch.setattr("nograd.observability.stats.os.getpid", lambda: pid)
    statistics = Statistics(shared)
    statistics.of("digits")  # the file is named when the model's counters are made
    return statistics


def test_workers_sharing_a_folder_report_the_whole_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _as_process(monkeypatch, 101, tmp_path)
    second = _as_process(monkeypatch, 102, tmp_path)
    first.of("digits").request_succeeded(rows=2, seconds=0.5)
    first.of("digits").batch_started([0.001, 0.001])
    first.of("digits").batch_finished(rows=2, seconds=0.01, ok=True)
    second.of("digits").request_succeeded(rows=1, seconds=0.25)
    second.of("digits").request_failed(seconds=0.125)
    second.of("digits").batch_started([0.002])
    second.of("digits").batch_finished(rows=200, seconds=0.02, ok=True)  # past the first table
    second.of("other").request_succeeded(rows=7, seconds=1.0)

    # Either worker answers with both workers' counts; another model's stay apart.
    documents = [s.of("digits").document("digits", "1") for s in (first, second)]
    assert documents[0] == documents[1]
    document = documents[0]
    inference = document["inference_stats"]
    assert inference["success"] == {"count": 2, "ns": 750_000_000}
    assert inference["fail"] == {"count": 1, "ns": 125_000_000}
    assert inference["queue"] == {"count": 3, "ns": 4_000_000}
    assert inference["compute_infer"] == {"count": 3, "ns": 2 * 10_000_000 + 20_000_000}
    assert document["inference_count"] == 3 and document["execution_count"] == 2
    assert [(b["batch_size"], b["compute_infer"]) for b in document["batch_stats"]] == [
        (2, {"count": 1, "ns": 10_000_000}),
        (200, {"count": 1, "ns": 20_000_000}),
    ]
    assert document["last_inference"] > 0
    assert first.of("other").document("other", "1")["inference_count"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"v2stats_{name.encode().hex()}_{pid}.i64"
        for name, pid in (("digits", 101), ("digits", 102), ("other", 102))
    )

    # A worker started again under a pid seen before carries on from that file's counts.
    again = _as_process(monkeypatch, 102, tmp_path)
    again.of("digits").request_succeeded(rows=1, seconds=0.0)
    assert again.of("digits").document("digits", "1")["inference_count"] == 4
    assert again.of("digits").document("digits", "1")["batch_stats"][-1]["batch_size"] == 200


def test_batch_sizes_past_the_first_table_in_memory() -> None:
    stats = ModelStatistics()
    for rows in (1, 64, 65, 1000):
        stats.batch_started([0.0])
        stats.batch_finished(rows=rows, seconds=0.001, ok=True)
    sizes = [b["batch_size"] for b in stats.document("m", "1")["batch_stats"]]
    assert sizes == [1, 64, 65, 1000]


@dataclass(frozen=True)
class _Part:
    rows: int
    length: int = 1

    def slice(self, start: int, stop: int) -> Self:
        return type(self)(stop - start, self.length)


class _Runner:
    def run_batch(self, parts: Sequence[_Part]) -> list[int]:
        return [p.rows for p in parts]

    def concat(self, results: Sequence[int]) -> int:
        return sum(results)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return False

    def release_memory(self) -> None:
        pass


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def queue_depth(self, depth: int) -> None:
        self.events.append("queue_depth")

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None:
        self.events.append("batch_started")

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        self.events.append("batch_finished")

    def out_of_memory(self, cost: int) -> None:
        self.events.append("out_of_memory")

    def split(self) -> None:
        self.events.append("split")

    def limit_changed(self, limit: int) -> None:
        self.events.append("limit_changed")

    def dropped(self, reason: str) -> None:
        self.events.append("dropped")


async def test_fan_out_feeds_statistics_and_other_observers_from_a_batcher() -> None:
    statistics = Statistics()
    recorder = _Recorder()
    with ThreadPoolExecutor(max_workers=1) as executor:
        batcher: Batcher[_Part, int] = Batcher(
            "m",
            _Runner(),
            executor,
            BatchLimit(8),
            max_queue_delay_s=0.0,
            max_queue_size=16,
            observer=FanOutObserver(recorder, statistics.observer("m")),
        )
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit(_Part(2)) for _ in range(3)))
        await batcher.stop()
    assert results == [2, 2, 2]
    document = statistics.of("m").document("m", "1")
    assert document["inference_stats"]["queue"]["count"] == 3
    assert document["inference_stats"]["compute_infer"]["count"] == 3
    assert sum(b["compute_infer"]["count"] * b["batch_size"] for b in document["batch_stats"]) == 6
    assert {"batch_started", "batch_finished", "queue_depth"} <= set(recorder.events)
    # Every observer method is forwarded.
    fan = FanOutObserver(recorder)
    before = len(recorder.events)
    fan.out_of_memory(1)
    fan.split()
    fan.limit_changed(4)
    fan.dropped("cancelled")
    assert recorder.events[before:] == ["out_of_memory", "split", "limit_changed", "dropped"]
