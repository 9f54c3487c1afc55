"""Per-model inference statistics in the shape of Triton's statistics extension.

Prometheus histograms (``nograd.observability.metrics``) are the way to watch a fleet; these
cumulative counters
answer ``GET /v2/models[/{name}]/stats`` for clients that already read Triton's (tritonclient's
``get_inference_statistics``, perf_analyzer). They are fed by the data plane, once per request,
and by the batcher through :class:`StatsObserver`, once per batch. Batch events arrive on the
device threads and requests on the event loop, so every update holds the model's lock.

With several worker processes every worker keeps its counters in a file of its own in the shared
metrics folder, and a statistics request on any worker adds up every worker's file: the answer is
the whole server's, whichever worker a client's connection landed on. A dead worker's file stays,
so the totals never go backwards when it is restarted (as Prometheus counters do).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nograd.batching import BatchObserver, NullObserver

STATS_PREFIX = "v2stats_"
"""Names of the workers' statistics files in the shared folder, next to the metric files."""
_NS = 1_000_000_000

# Layout of one model's counters (int64): these fields, then (count, ns) for each batch size.
_SUCCESS_COUNT, _SUCCESS_NS = 0, 1
_FAIL_COUNT, _FAIL_NS = 2, 3
_QUEUE_COUNT, _QUEUE_NS = 4, 5
_COMPUTE_COUNT, _COMPUTE_NS = 6, 7
_INFERENCE_COUNT = 8
_EXECUTION_COUNT = 9
_LAST_INFERENCE_MS = 10
_BATCHES = 11
_FIRST_BATCH_SIZES = 64
FILE_SUFFIX = ".i64"


def _batch_slot(rows: int) -> int:
    return _BATCHES + 2 * (rows - 1)


class _Counters:
    """A model's int64 counters: in memory, or in this process's file for the other workers.

    The file is memory-mapped, so an update costs what an in-memory one does; readers in other
    processes read it through the same page cache. It only grows (a new batch size), with zeros.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.values = self._mapped(_BATCHES + 2 * _FIRST_BATCH_SIZES)

    def _mapped(self, size: int) -> np.ndarray:
        if self.path is None:
            return np.zeros(size, dtype=np.int64)
        with open(self.path, "ab") as file:
            # A file of the same pid (a worker that died) is continued, never shrunk.
            size = max(size, file.tell() // 8)
            file.truncate(size * 8)
        mapped = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(size,))
        return mapped.view(np.ndarray)

    def fit(self, index: int) -> None:
        if index < len(self.values):
            return
        size = max(index + 1, 2 * len(self.values))
        if self.path is None:
            grown = np.zeros(size, dtype=np.int64)
            grown[: len(self.values)] = self.values
            self.values = grown
        else:
            self.values = self._mapped(size)


def _added_up(files: Sequence[Path]) -> np.ndarray:
    """Every worker's counters of one model, summed (the last inference: the latest)."""
    total = np.zeros(_BATCHES, dtype=np.int64)
    last = 0
    for path in files:
        try:
            values = np.fromfile(path, dtype=np.int64)
        except (FileNotFoundError, ValueError):
            continue
        if len(values) > len(total):
            total = np.concatenate([total, np.zeros(len(values) - len(total), dtype=np.int64)])
        total[: len(values)] += values
        if len(values) > _LAST_INFERENCE_MS:
            last = max(last, int(values[_LAST_INFERENCE_MS]))
    total[_LAST_INFERENCE_MS] = last
    return total


def _pair(values: np.ndarray, count: int, ns: int) -> dict[str, int]:
    return {"count": int(values[count]), "ns": int(values[ns])}


class ModelStatistics:
    """Cumulative counters of one model since the server started.

    With ``shared`` (a folder and this model's file-name stem) the counters live in this
    process's file there and :meth:`document` adds up every process's file of the model.
    """

    def __init__(self, shared: tuple[Path, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._shared = shared
        path = None
        if shared is not None:
            folder, stem = shared
            path = folder / f"{stem}_{os.getpid()}{FILE_SUFFIX}"
        self._counters = _Counters(path)
        # batch_started and batch_finished of one batch run on the same device thread, one after
        # the other; the request count of the batch in between is kept per thread.
        self._running = threading.local()

    # ----------------------------------------------------------------- from the data plane
    def request_succeeded(self, rows: int, seconds: float) -> None:
        with self._lock:
            values = self._counters.values
            values[_SUCCESS_COUNT] += 1
            values[_SUCCESS_NS] += round(seconds * _NS)
            values[_INFERENCE_COUNT] += rows
            values[_LAST_INFERENCE_MS] = _now_ms()

    def request_failed(self, seconds: float) -> None:
        with self._lock:
            values = self._counters.values
            values[_FAIL_COUNT] += 1
            values[_FAIL_NS] += round(seconds * _NS)
            values[_LAST_INFERENCE_MS] = _now_ms()

    # ----------------------------------------------------------------- from the batcher
    def batch_started(self, queue_waits: Sequence[float]) -> None:
        self._running.requests = len(queue_waits)
        with self._lock:
            values = self._counters.values
            values[_QUEUE_COUNT] += len(queue_waits)
            values[_QUEUE_NS] += round(sum(queue_waits) * _NS)

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        requests = getattr(self._running, "requests", 1)
        self._running.requests = 1
        if not ok or rows < 1:
            return
        ns = round(seconds * _NS)
        slot = _batch_slot(rows)
        with self._lock:
            self._counters.fit(slot + 1)
            values = self._counters.values
            values[_EXECUTION_COUNT] += 1
            # Triton counts compute per request: each request of the batch waited for all of it.
            values[_COMPUTE_COUNT] += requests
            values[_COMPUTE_NS] += ns * requests
            values[slot] += 1
            values[slot + 1] += ns

    # ----------------------------------------------------------------- reporting
    def _totals(self) -> np.ndarray:
        if self._shared is None:
            with self._lock:
                return self._counters.values.copy()
        folder, stem = self._shared
        return _added_up(sorted(folder.glob(f"{stem}_*{FILE_SUFFIX}")))

    def document(self, name: str, version: str) -> dict[str, Any]:
        """One ``$model_stat`` object of the statistics extension."""
        values = self._totals()
        compute = _pair(values, _COMPUTE_COUNT, _COMPUTE_NS)
        # Collate, forward and copy-back are timed as one span, reported as compute_infer;
        # compute_input and compute_output carry the same counts and no separate time.
        included = {"count": compute["count"], "ns": 0}
        batches = values[_BATCHES:]
        return {
            "name": name,
            "version": version,
            "last_inference": int(values[_LAST_INFERENCE_MS]),
            "inference_count": int(values[_INFERENCE_COUNT]),
            "execution_count": int(values[_EXECUTION_COUNT]),
            "inference_stats": {
                "success": _pair(values, _SUCCESS_COUNT, _SUCCESS_NS),
                "fail": _pair(values, _FAIL_COUNT, _FAIL_NS),
                "queue": _pair(values, _QUEUE_COUNT, _QUEUE_NS),
                "compute_input": dict(included),
                "compute_infer": compute,
                "compute_output": dict(included),
                "cache_hit": {"count": 0, "ns": 0},
                "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [
                {
                    "batch_size": index + 1,
                    "compute_input": {"count": int(batches[2 * index]), "ns": 0},
                    "compute_infer": _pair(batches, 2 * index, 2 * index + 1),
                    "compute_output": {"count": int(batches[2 * index]), "ns": 0},
                }
                for index in range(len(batches) // 2)
                if batches[2 * index]
            ],
        }


class Statistics:
    """Every model's statistics; one instance per server process, models added on first use.

    ``shared_dir``: the folder the worker processes of one server share (their metrics folder);
    each model's counters are then the whole server's.
    """

    def __init__(self, shared_dir: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._dir = shared_dir
        self._models: dict[str, ModelStatistics] = {}

    def of(self, model: str) -> ModelStatistics:
        with self._lock:
            stats = self._models.get(model)
            if stats is None:
                # Hex: a model's name may hold characters a file name should not.
                shared = None
                if self._dir is not None:
                    shared = (self._dir, f"{STATS_PREFIX}{model.encode().hex()}")
                stats = self._models[model] = ModelStatistics(shared)
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
