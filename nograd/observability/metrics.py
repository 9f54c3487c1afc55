"""Every Prometheus metric nograd exports, declared once.

Names carry the ``nograd_`` prefix and base units (seconds, bytes); counters end in ``_total``;
labels are bounded (model, version, protocol, status code, device, reason) and never a raw path.
Histograms, not summaries, so latency tails aggregate across replicas.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Final, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    values,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from nograd.observability.metric_values import remember_process_id

# Geometric, factor ~1.33, from 0.5 ms to ~13 s: fine enough to read p50..p99.9 in that range.
DURATION_BUCKETS: Final = tuple(round(0.0005 * 1.3335**k, 6) for k in range(36))
# Queue waits and forwards are shorter; start lower.
STAGE_BUCKETS: Final = tuple(round(0.00005 * 1.3335**k, 7) for k in range(44))
BATCH_SIZE_BUCKETS: Final = tuple(float(2**k) for k in range(17))
BYTES_BUCKETS: Final = tuple(float(2**k) for k in range(10, 41))
# Loading a model on demand: from 10 ms to ~20 min, factor 1.5.
LOAD_BUCKETS: Final = tuple(round(0.01 * 1.5**k, 4) for k in range(36))
UNKNOWN_MODEL: Final = "_unknown"
"""Label value for requests naming no served model, so random names cannot explode cardinality."""

# The *_created series double the exposition size and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

remember_process_id()

MemoryReader = Callable[[], Iterable[tuple[str, int, int, int, int]]]
"""Yields (device, allocated, reserved, peak, total) bytes at scrape time."""


_Mode = Literal["livesum", "livemax"]
_DEVICE_MEMORY: Final[tuple[tuple[str, str, _Mode], ...]] = (
    ("allocated", "Bytes in use: torch allocator on CUDA, process resident on CPU.", "livesum"),
    ("reserved", "Bytes reserved: CUDA caching allocator, process resident on CPU.", "livesum"),
    ("peak", "Peak bytes in use since start (or last reset).", "livesum"),
    ("total", "Device capacity: GPU memory, or system memory on CPU.", "livemax"),
)
"""Device memory series; with several workers each one's usage is added up, capacity is not
(so ``peak`` is the sum of each worker's own peak: an upper bound of the server's)."""


class _DeviceMemoryCollector(Collector):
    """Reads device memory when Prometheus scrapes, so the numbers are never stale."""

    def __init__(self, reader: MemoryReader) -> None:
        self._reader = reader

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = [
            GaugeMetricFamily(f"nograd_device_memory_{key}_bytes", doc, labels=["device"])
            for key, doc, _ in _DEVICE_MEMORY
        ]
        for device, *readings in self._reader():
            for family, value in zip(families, readings, strict=True):
                family.add_metric([device], value)
        yield from families

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class Metrics:
    """The metric set of one server; tests build several, each on its own registry.

    With ``multiprocess_dir`` (one of several worker processes) every value lives in that folder's
    files, and ``exposition`` reads all workers' files, so any worker that answers a scrape
    reports the whole server: counters and histograms summed, gauges by their declared mode.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, multiprocess_dir: Path | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.exposition = self.registry
        """The registry /metrics renders."""
        self._memory_reader: MemoryReader | None = None
        self._memory_gauges: list[Gauge] = []
        if multiprocess_dir is not None:
            _require_multiprocess_values(multiprocess_dir)
            self.exposition = CollectorRegistry()
            MultiProcessCollector(self.exposition, path=str(multiprocess_dir))  # type: ignore[no-untyped-call]
        r = self.registry
        self._request_children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self.requests = Counter(
            "nograd_requests", "Requests answered.", ["model", "protocol", "code"], registry=r
        )
        self.request_duration = Histogram(
            "nograd_request_duration_seconds",
            "End-to-end request latency, from body received to response ready.",
            ["model", "protocol"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "nograd_queue_duration_seconds",
            "Time from enqueue to the start of the request's batch.",
            ["model"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.batch_duration = Histogram(
            "nograd_batch_duration_seconds",
            "Duration of one batch on the device (collate, forward, copy back).",
            ["model"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "nograd_batch_size",
            "Samples per batch.",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "nograd_queue_depth",
            "Requests waiting in the model's queue.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.inflight = Gauge(
            "nograd_inflight_requests",
            "Inference requests being handled now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.model_load = Gauge(
            "nograd_model_load_seconds",
            "Time to load the model.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_warmup = Gauge(
            "nograd_model_warmup_seconds",
            "Time to warm the model up.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.workers_ready = Gauge(
            "nograd_workers_ready",
            "Server processes that finished loading their models and serve (NOGRAD_WORKERS).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.model_ready = Gauge(
            "nograd_model_ready",
            "1 when the model serves requests.",
            ["model"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.memory_budget = Gauge(
            "nograd_device_memory_budget_bytes",
            "Activation memory batches may use on the device.",
            ["device"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_limit = Gauge(
            "nograd_batch_limit",
            "Current batch limit, in the model's unit (samples or padded tokens).",
            ["model"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.sample_bytes = Gauge(
            "nograd_model_sample_bytes",
            "Measured activation bytes per sample (or per token).",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.engine_unit_bytes = Gauge(
            "nograd_model_engine_unit_bytes",
            "Planned activation bytes per sample (or per token) of each engine serving a range of "
            "the model's batch sizes, measured as that engine allocates.",
            ["model", "engine"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.memory_fit_error = Gauge(
            "nograd_model_memory_fit_error",
            "Signed relative error of the memory fit each engine range is planned on, at its "
            "last check: (predicted - measured) / measured, below 0 when it promised less.",
            ["model", "engine"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.weights_bytes = Gauge(
            "nograd_model_weights_bytes",
            "Bytes of parameters and buffers.",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_loads = Counter(
            "nograd_model_loads",
            "Models loaded on their first request (NOGRAD_MODEL_CONTROL=on_demand).",
            ["model"],
            registry=r,
        )
        self.model_evictions = Counter(
            "nograd_model_evictions",
            "Resident models evicted to stay within the memory limit, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.load_duration = Histogram(
            "nograd_model_load_duration_seconds",
            "Time an on-demand load took, eviction and memory plan included.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.load_wait = Histogram(
            "nograd_model_load_wait_seconds",
            "Time a request waited for its model to be loaded on demand: a stage of its latency "
            "beside its queue and its batch (requests that found it resident are not counted).",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.models_resident = Gauge(
            "nograd_models_resident",
            "Models resident (loaded) under on-demand control, all workers together.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.resident_bytes = Gauge(
            "nograd_model_resident_bytes",
            "Bytes a resident model holds against the memory limit: its weights and its "
            "smallest batch, as measured at its load (all workers together).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.memory_limit = Gauge(
            "nograd_memory_limit_bytes",
            "The memory limit resident models are kept within under on-demand control "
            "(NOGRAD_MEMORY_LIMIT_BYTES): each worker's part, all workers together.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.memory_free = Gauge(
            "nograd_memory_free_bytes",
            "Room left under the memory limit beside the resident models: what a model may "
            "hold and load without an eviction (all workers together).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.model_loading = Gauge(
            "nograd_model_loading",
            "Loads of the model on demand under way or waiting their turn (all workers).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.model_inflight = Gauge(
            "nograd_model_inflight_requests",
            "Requests holding the model under on-demand control: waiting for its load, queued, "
            "running or being answered (all workers).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_predicted_bytes = Histogram(
            "nograd_batch_predicted_bytes",
            "Predicted peak activation bytes of each batch.",
            ["model"],
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.oom = Counter(
            "nograd_oom", "Out-of-memory errors caught in a forward.", ["model"], registry=r
        )
        self.batch_splits = Counter(
            "nograd_batch_splits",
            "Batches split in halves after an out-of-memory error or a failing sample.",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            "nograd_rejected",
            "Requests refused before compute.",
            ["model", "reason"],
            registry=r,
        )
        self.dropped = Counter(
            "nograd_dropped",
            "Queued requests dropped before their batch ran.",
            ["model", "reason"],
            registry=r,
        )
        self.inference_errors = Counter(
            "nograd_inference_errors",
            "Requests the model raised on; bisection pins each error on its own request.",
            ["model"],
            registry=r,
        )
        self.accuracy_delta = Gauge(
            "nograd_model_accuracy_delta",
            "Max abs error of a speed mode's float outputs vs fp32 eager, measured at load "
            "(warmup and held-out inputs); mode is e.g. bf16, compile, bf16+compile.",
            ["model", "mode"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.accuracy_cosine_min = Gauge(
            "nograd_model_accuracy_cosine_min",
            "Min per-sample cosine similarity of a speed mode's float outputs vs fp32 eager.",
            ["model", "mode"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.speedup = Gauge(
            "nograd_model_speedup",
            "A speed mode's speed over fp32 eager's on the warmup batches, timed at load on this "
            "machine (above 1 is faster); a mode under its min_speedup is refused.",
            ["model", "mode"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.batcher_restarts = Counter(
            "nograd_batcher_restarts",
            "Batch loops found dead and restarted.",
            ["model"],
            registry=r,
        )

    def request_done(self, model: str, protocol: str, status: int, seconds: float) -> None:
        """Count one answered call and time it; once per request, so label lookups are cached.

        ``labels()`` validates and locks on every call; the children for a label set never
        change, and the set of (model, protocol, status) seen is small and bounded.
        """
        key = (model, protocol, status)
        children = self._request_children.get(key)
        if children is None:
            children = (
                self.requests.labels(model, protocol, str(status)),
                self.request_duration.labels(model, protocol),
            )
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def watch_device_memory(self, reader: MemoryReader) -> None:
        if self.exposition is self.registry:
            self.registry.register(_DeviceMemoryCollector(reader))
            return
        # A collector runs only in the worker that answers the scrape; other workers' memory
        # reaches the files through gauges, refreshed by sample_device_memory.
        self._memory_reader = reader
        self._memory_gauges = [
            Gauge(
                f"nograd_device_memory_{key}_bytes",
                doc,
                ["device"],
                registry=self.registry,
                multiprocess_mode=mode,
            )
            for key, doc, mode in _DEVICE_MEMORY
        ]
        self.sample_device_memory()

    def sample_device_memory(self) -> None:
        """Copy this worker's device memory into the shared files (no-op in one process)."""
        if self._memory_reader is None:
            return
        for device, *readings in self._memory_reader():
            for gauge, value in zip(self._memory_gauges, readings, strict=True):
                gauge.labels(device).set(value)

    def memory_fits(self, model: str, fits: Iterable[tuple[str, float, float]]) -> None:
        """A model's plan, per engine range: (engine, bytes per unit, signed check error)."""
        for engine, unit_bytes, error in fits:
            self.engine_unit_bytes.labels(model, engine).set(unit_bytes)
            self.memory_fit_error.labels(model, engine).set(error)

    def observer(self, model: str) -> ModelObserver:
        return ModelObserver(self, model)


def _require_multiprocess_values(directory: Path) -> None:
    """prometheus_client picks file-backed values once, at import, from PROMETHEUS_MULTIPROC_DIR;
    a worker that imported it without the variable would count only in its own memory."""
    file_backed = values.ValueClass is not values.MutexValue
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") != str(directory) or not file_backed:
        raise RuntimeError(
            f"multiprocess metrics need PROMETHEUS_MULTIPROC_DIR={directory} set before "
            "prometheus_client is imported"
        )


class ModelObserver:
    """The batcher's observer for one model: translates batching events into metrics."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._queue_depth = metrics.queue_depth.labels(model)
        self._queue_duration = metrics.queue_duration.labels(model)
        self._batch_duration = metrics.batch_duration.labels(model)
        self._batch_size = metrics.batch_size.labels(model)
        self._oom = metrics.oom.labels(model)
        self._splits = metrics.batch_splits.labels(model)
        self._limit = metrics.batch_limit.labels(model)
        self._dropped = metrics.dropped
        self._predicted = metrics.batch_predicted_bytes.labels(model)
        self._model = model
        self.predict_bytes: Callable[[int, int], float] | None = None
        """Set once memory is profiled: predicted peak bytes for a batch's (rows, cost)."""

    def queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None:
        self._batch_size.observe(rows)
        for wait in queue_waits:
            self._queue_duration.observe(wait)
        if self.predict_bytes is not None:
            self._predicted.observe(self.predict_bytes(rows, cost))

    def batch_finished(self, rows: int, seconds: float, ok: bool) -> None:
        del rows, ok
        self._batch_duration.observe(seconds)

    def out_of_memory(self, cost: int) -> None:
        del cost
        self._oom.inc()

    def split(self) -> None:
        self._splits.inc()

    def limit_changed(self, limit: int) -> None:
        self._limit.set(limit)

    def dropped(self, reason: str) -> None:
        self._dropped.labels(self._model, reason).inc()
