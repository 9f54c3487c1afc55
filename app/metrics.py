"""Every Prometheus metric nograd exports, declared once.

Names carry the ``nograd_`` prefix and base units (seconds, bytes); counters end in ``_total``;
labels are bounded (model, version, protocol, status code, device, reason) and never a raw path.
Histograms, not summaries, so latency tails aggregate across replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Geometric, factor ~1.33, from 0.5 ms to ~13 s: fine enough to read p50..p99.9 in that range.
DURATION_BUCKETS: Final = tuple(round(0.0005 * 1.3335**k, 6) for k in range(36))
# Queue waits and forwards are shorter; start lower.
STAGE_BUCKETS: Final = tuple(round(0.00005 * 1.3335**k, 7) for k in range(44))
BATCH_SIZE_BUCKETS: Final = tuple(float(2**k) for k in range(17))
BYTES_BUCKETS: Final = tuple(float(2**k) for k in range(10, 41))
UNKNOWN_MODEL: Final = "_unknown"
"""Label value for requests naming no served model, so random names cannot explode cardinality."""

# The *_created series double the exposition size and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

MemoryReader = Callable[[], Iterable[tuple[str, int, int, int, int]]]
"""Yields (device, allocated, reserved, peak, total) bytes at scrape time."""


class _DeviceMemoryCollector(Collector):
    """Reads device memory when Prometheus scrapes, so the numbers are never stale."""

    def __init__(self, reader: MemoryReader) -> None:
        self._reader = reader

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = {
            key: GaugeMetricFamily(f"nograd_device_memory_{key}_bytes", doc, labels=["device"])
            for key, doc in (
                ("allocated", "Bytes in use: torch allocator on CUDA, process resident on CPU."),
                ("reserved", "Bytes reserved: CUDA caching allocator, process resident on CPU."),
                ("peak", "Peak bytes in use since start (or last reset)."),
                ("total", "Device capacity: GPU memory, or system memory on CPU."),
            )
        }
        for device, allocated, reserved, peak, total in self._reader():
            families["allocated"].add_metric([device], allocated)
            families["reserved"].add_metric([device], reserved)
            families["peak"].add_metric([device], peak)
            families["total"].add_metric([device], total)
        yield from families.values()

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class Metrics:
    """The metric set of one server; tests build several, each on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
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
            "nograd_queue_depth", "Requests waiting in the model's queue.", ["model"], registry=r
        )
        self.inflight = Gauge(
            "nograd_inflight_requests", "Inference requests being handled now.", registry=r
        )
        self.model_load = Gauge(
            "nograd_model_load_seconds", "Time to load the model.", ["model"], registry=r
        )
        self.model_warmup = Gauge(
            "nograd_model_warmup_seconds", "Time to warm the model up.", ["model"], registry=r
        )
        self.model_ready = Gauge(
            "nograd_model_ready", "1 when the model serves requests.", ["model"], registry=r
        )
        self.memory_budget = Gauge(
            "nograd_device_memory_budget_bytes",
            "Activation memory batches may use on the device.",
            ["device"],
            registry=r,
        )
        self.batch_limit = Gauge(
            "nograd_batch_limit",
            "Current batch limit, in the model's unit (samples or padded tokens).",
            ["model"],
            registry=r,
        )
        self.sample_bytes = Gauge(
            "nograd_model_sample_bytes",
            "Measured activation bytes per sample (or per token).",
            ["model"],
            registry=r,
        )
        self.weights_bytes = Gauge(
            "nograd_model_weights_bytes", "Bytes of parameters and buffers.", ["model"], registry=r
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
        )
        self.accuracy_cosine_min = Gauge(
            "nograd_model_accuracy_cosine_min",
            "Min per-sample cosine similarity of a speed mode's float outputs vs fp32 eager.",
            ["model", "mode"],
            registry=r,
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
        self.registry.register(_DeviceMemoryCollector(reader))

    def observer(self, model: str) -> ModelObserver:
        return ModelObserver(self, model)


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
