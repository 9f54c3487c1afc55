"""Per-model inference statistics in the shape of Triton's statistics extension.

Prometheus histograms (``app.metrics``) are the way to watch a fleet; these cumulative counters
answer ``GET /v2/models[/{name}]/stats`` for clients that already read Triton's (tritonclient's
``get_inference_statistics``, perf_analyzer). They are fed by the data plane, once per request,
and by the batcher through :class:`StatsObserver`, once per batch. Batch events arrive on the
device threads and requests on the event loop, so every update holds the model's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.batching import BatchObserver, NullObserver

_NS = 1_000_000_000


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += round(seconds * _NS)

    def document(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class ModelStatistics:
    """Cumulative counters of one model since the server started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._success = _Duration()
        self._fail = _Duration()
        self._queue = _Duration()
        self._compute = _Duration()
        self._batches: dict[int, _Duration] = {}
        self._inference_count = 0
        self._execution_count = 0
        self._last_inference_ms = 0
        # batch_started and batch_finished of one batch run on the same device thread, one after
        # the other; the request count of the batch in between is kept per thread.
        self._running = threading.local()

    # ----------------------------------------------------------------- from the data plane
    def request_succeeded(self, rows: int, seconds: float) -> None:
        with self._lock:
            self._success.add(seconds)
            self._inference_count += rows
            self._last_inference_ms = _now_ms()

    def request_failed(self, seconds: float) -> None:
        with self._lock:
            self._fail.add(seconds)
            self._last_inference_ms = _now_ms()

    # ----------------------------------------------------------------- from the batcher
    def batch_started(self, queue_waits: Sequence[float]) -> None:
        self._running.requests = len(queue_waits)
        with self._lock:
            self._queue.add(sum(queue_waits), len(queue_waits))

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        requests = getattr(self._running, "requests", 1)
        self._running.requests = 1
        if not ok:
            return
        with self._lock:
            self._execution_count += 1
            # Triton counts compute per request: each request of the batch waited for all of it.
            self._compute.add(seconds * requests, requests)
            self._batches.setdefault(rows, _Duration()).add(seconds)

    # ----------------------------------------------------------------- reporting
    def document(self, name: str, version: str) -> dict[str, Any]:
        """One ``$model_stat`` object of the statistics extension."""
        with self._lock:
            compute = self._compute.document()
            # Collate, forward and copy-back are timed as one span, reported as compute_infer;
            # compute_input and compute_output carry the same counts and no separate time.
            included = {"count": compute["count"], "ns": 0}
            return {
                "name": name,
                "version": version,
                "last_inference": self._last_inference_ms,
                "inference_count": self._inference_count,
                "execution_count": self._execution_count,
                "inference_stats": {
                    "success": self._success.document(),
                    "fail": self._fail.document(),
                    "queue": self._queue.document(),
                    "compute_input": dict(included),
                    "compute_infer": compute,
                    "compute_output": dict(included),
                    "cache_hit": {"count": 0, "ns": 0},
                    "cache_miss": {"count": 0, "ns": 0},
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": stat.count, "ns": 0},
                        "compute_infer": stat.document(),
                        "compute_output": {"count": stat.count, "ns": 0},
                    }
                    for size, stat in sorted(self._batches.items())
                ],
            }


class Statistics:
    """Every model's statistics; one instance per server, models added on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelStatistics] = {}

    def of(self, model: str) -> ModelStatistics:
        with self._lock:
            stats = self._models.get(model)
            if stats is None:
                stats = self._models[model] = ModelStatistics()
            return stats

    def observer(self, model: str) -> StatsObserver:
        return StatsObserver(self.of(model))


class StatsObserver(NullObserver):
    """The batcher's observer for statistics: queue waits and batch compute durations."""

    def __init__(self, stats: ModelStatistics) -> None:
        self._stats = stats

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None:
        self._stats.batch_started(queue_waits)

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        self._stats.batch_finished(rows, seconds, ok)


class FanOutObserver:
    """Passes every batcher event to several observers (metrics and statistics), in order."""

    def __init__(self, *observers: BatchObserver) -> None:
        self._observers = observers

    def queue_depth(self, depth: int) -> None:
        for observer in self._observers:
            observer.queue_depth(depth)

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None:
        for observer in self._observers:
            observer.batch_started(rows, cost, queue_waits)

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        for observer in self._observers:
            observer.batch_finished(rows, seconds, ok)

    def out_of_memory(self, cost: int) -> None:
        for observer in self._observers:
            observer.out_of_memory(cost)

    def split(self) -> None:
        for observer in self._observers:
            observer.split()

    def limit_changed(self, limit: int) -> None:
        for observer in self._observers:
            observer.limit_changed(limit)

    def dropped(self, reason: str) -> None:
        for observer in self._observers:
            observer.dropped(reason)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
