"""Statistics extension counters (``app/stats.py``), driven directly and through a real batcher."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

from app.batching import Batcher, BatchLimit
from app.stats import FanOutObserver, ModelStatistics, Statistics


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


def test_counters_are_exact_under_concurrent_updates() -> None:
    stats = ModelStatistics()

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
