"""The one core every protocol calls: models, their batchers, readiness and inference.

HTTP routes (V2, OpenAI) stay thin and protocol-specific; everything they share lives here, so a
behaviour (validation, deadlines, metrics) is written once.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nograd.batching import (
    Batcher,
    BatcherClosed,
    BatchingError,
    BatchLimit,
    DeadlineExceeded,
    QueueFull,
    SampleTooLarge,
)
from nograd.core.datatypes import datatype_of, shape_matches
from nograd.host.ledger import CoreLedger, CoreShare
from nograd.observability.metrics import Metrics, ModelObserver
from nograd.observability.stats import FanOutObserver, Statistics
from nograd.runtime.config import ConfigError, ModelConfig, find_config, load_config
from nograd.runtime.devices import (
    DeviceThreads,
    configure_threads,
    device_label,
    read_memory,
    resolve_device,
)
from nograd.runtime.handler import ModelHandler, Outputs, TensorPart, TorchRunner
from nograd.runtime.loader import build_handler, weights_bytes
from nograd.runtime.memory import Profile, probe_for
from nograd.runtime.planner import ModelPlan, PlanInput, log_plan, plan_device, profile_handler
from nograd.runtime.speed.guard import apply_speed
from nograd.runtime.speed.path import batch_cap
from nograd.runtime.warmup import warm_up
from nograd.serving.speed_checks import load_accuracy_sample, recorder
from nograd.settings import Settings

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class ModelNotFound(Exception):
    """No model (or version) of that name is in the repository."""


class ModelNotReady(Exception):
    """The model exists but is loading, failed to load, or is draining."""


class InvalidInput(Exception):
    """The request does not match the model's declared inputs; the message says how."""


class LimitExceeded(Exception):
    """The request is well formed but over a configured limit (rows, text length)."""


class InferenceFailed(Exception):
    """The model raised on this request (after bisection, on this request alone)."""


class Draining(ModelNotReady):
    """The server received SIGTERM and finishes accepted work only."""


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ServedModel:
    """One model as served: its config, and once loaded its handler and batcher."""

    config: ModelConfig
    directory: Path
    state: State = State.LOADING
    error: str | None = None
    handler: ModelHandler | None = None
    batcher: Batcher[TensorPart, Outputs] | None = None
    observer: ModelObserver | None = None
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    weights_bytes: int = 0
    plan: ModelPlan | None = None
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> str:
        return self.config.version

    @property
    def ready(self) -> bool:
        return self.state is State.READY and self.batcher is not None and self.batcher.alive


class DataPlane:
    """Owns every model of the repository and runs inference on them."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        statistics: Statistics | None = None,
        *,
        cores: CoreShare | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self.config_errors: list[str] = []
        self._threads = DeviceThreads()
        self._draining = False
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._loaded = asyncio.Event()
        self.statistics = statistics or Statistics()
        self._core_share = cores
        self._cores: CoreLedger | None = None
        """Joined at load: the CPU cores shared with the other workers, batch by batch."""
        metrics.watch_device_memory(self._memory_readings)

    # ------------------------------------------------------------------ discovery and loading
    def discover(self) -> None:
        """Read every model config; a malformed one is logged and its model shows failed."""
        root = self.settings.model_repository
        if not root.is_dir():
            raise ConfigError(f"model repository {str(root)!r} is not a folder")
        for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            path = find_config(model_dir)
            if path is None:
                continue
            try:
                config = load_config(path)
            except ConfigError as exc:
                logger.error("model config rejected: %s", exc)
                self.config_errors.append(str(exc))
                continue
            if config.name in self.models:
                message = f"{path}: field 'name': model {config.name!r} is defined twice"
                logger.error("model config rejected: %s", message)
                self.config_errors.append(message)
                continue
            self.models[config.name] = ServedModel(config, model_dir)
            self.metrics.model_ready.labels(config.name).set(0)

    async def load_all(self) -> None:
        """Load and warm up every model, plan memory per device, then start the batchers.

        Planning waits for every load so the free memory it budgets already excludes all
        weights; a model that fails at any step is reported and left not ready.
        """
        loop = asyncio.get_running_loop()
        share = self._core_share
        threads = configure_threads(
            self.settings.torch_threads, self.settings.worker_count, shared=share is not None
        )
        if share is not None:
            self._cores = CoreLedger(share, threads)
            logger.info(
                "torch intra-op threads: up to %d per batch, the cores the other %d workers' "
                "batches leave free",
                threads,
                self.settings.worker_count - 1,
            )
        else:
            logger.info("torch intra-op threads: %d", threads)
        for model in self.models.values():
            try:
                # On the thread that will run the model's batches: torch's OpenMP workers belong
                # to the thread that first ran a parallel op, and a second team from a loading
                # thread slowed every later forward (minilm batch 1: ~14 -> ~17 ms); on a GPU the
                # current stream and graphs captured during warm-up belong to this thread too.
                device = resolve_device(model.config.device)
                executor = self._threads.executor(device)
                await loop.run_in_executor(executor, self._load, model, device)
            except Exception as exc:
                self._failed(model, exc, "failed to load")
        await self._plan_memory()
        for model in self.models.values():
            if model.handler is not None and model.state is State.LOADING:
                try:
                    await self._start(model)
                except Exception as exc:
                    self._failed(model, exc, "failed to start")
        settle_heap()
        self._loaded.set()
        self.metrics.workers_ready.set(1)

    def _failed(self, model: ServedModel, exc: Exception, what: str) -> None:
        model.state = State.FAILED
        model.error = f"{what}: {exc}"
        logger.exception("model %s %s", model.name, what)

    async def _plan_memory(self) -> None:
        """Measure each loaded model's activation cost and derive its batch limit."""
        loop = asyncio.get_running_loop()
        by_device: dict[str, list[ServedModel]] = {}
        for model in self.models.values():
            if model.handler is not None and model.state is State.LOADING:
                by_device.setdefault(device_label(model.handler.device), []).append(model)
        for label, group in by_device.items():
            assert group[0].handler is not None
            device = group[0].handler.device
            probe = probe_for(device)
            executor = self._threads.executor(device)
            profiles: dict[str, Profile] = {}
            inputs: list[PlanInput] = []
            for model in group:
                assert model.handler is not None
                cap = self._measured_limit(model.config)
                try:
                    profiles[model.name] = await loop.run_in_executor(
                        executor, profile_handler, model.handler, probe, cap
                    )
                except Exception:
                    logger.exception(
                        "memory profiling of model %s failed; its limit stays at %d",
                        model.name,
                        cap,
                    )
                    continue
                inputs.append(PlanInput(model.name, model.handler, model.weights_bytes, cap))
            # Worker processes share the device: each takes an equal part of what it sees free
            # (a budget reserves nothing, so a later worker sees the earlier ones' budgets as free).
            workers = self.settings.worker_count
            explicit = self.settings.memory_budget_bytes
            budget, plans = plan_device(
                inputs,
                profiles,
                probe,
                fraction=self.settings.memory_fraction / workers,
                explicit_bytes=explicit // workers if explicit else None,
            )
            self.metrics.memory_budget.labels(label).set(budget)
            log_plan(label, budget, plans)
            for plan in plans:
                self.models[plan.name].plan = plan
                self.metrics.sample_bytes.labels(plan.name).set(plan.profile.model.per_unit)

    def _load(self, model: ServedModel, device: torch.device) -> None:
        config = model.config
        started = time.perf_counter()
        handler = build_handler(self.settings.model_repository, model.directory, config, device)
        # Speed modes (nograd.runtime.speed): build the config's faster mode, compile it and
        # check
        # it against fp32 eager; a refused mode leaves the handler fp32 eager. Counted as load time.
        sample = load_accuracy_sample(handler, model.directory)
        limit = self._measured_limit(config)
        handler = apply_speed(handler, limit, sample, recorder(self.metrics))
        model.load_seconds = time.perf_counter() - started
        self.metrics.model_load.labels(model.name).set(model.load_seconds)
        model.weights_bytes = weights_bytes(handler.module)
        self.metrics.weights_bytes.labels(model.name).set(model.weights_bytes)
        if self.settings.warmup:
            started = time.perf_counter()
            warm_up(handler, self._measured_limit(config))
            model.warmup_seconds = time.perf_counter() - started
            self.metrics.model_warmup.labels(model.name).set(model.warmup_seconds)
        model.handler = handler
        logger.info(
            "model %s v%s loaded on %s in %.2fs, warmed up in %.2fs",
            model.name,
            model.version,
            device_label(device),
            model.load_seconds,
            model.warmup_seconds,
        )

    def _measured_limit(self, config: ModelConfig) -> int:
        if config.batch_unit == "tokens":
            return config.max_batch_tokens or 16384
        return config.max_batch_size or self.settings.max_batch_size

    async def _start(self, model: ServedModel) -> None:
        assert model.handler is not None
        config = model.config
        observer = self.metrics.observer(model.name)
        if model.plan is not None:
            limit = BatchLimit(model.plan.limit)
            observer.predict_bytes = model.plan.predict_bytes
        else:
            limit = BatchLimit(self._measured_limit(config))
        # Fixed shapes: a batch above the largest bucket would run as several forwards, every
        # caller waiting for all of them; capped, the later callers form the next batch instead.
        limit.set_cap(batch_cap(model.handler))
        delay_ms = config.max_queue_delay_ms
        batcher: Batcher[TensorPart, Outputs] = Batcher(
            model.name,
            TorchRunner(model.handler, self._cores),
            self._threads.executor(model.handler.device),
            limit,
            max_queue_delay_s=(self.settings.max_queue_delay_ms if delay_ms is None else delay_ms)
            / 1000.0,
            max_queue_size=config.max_queue_size or self.settings.max_queue_size,
            unit_tokens=config.batch_unit == "tokens",
            observer=FanOutObserver(observer, self.statistics.observer(model.name)),
        )
        await batcher.start()
        observer.limit_changed(limit.current)
        model.batcher = batcher
        model.observer = observer
        model.state = State.READY
        self.metrics.model_ready.labels(model.name).set(1)

    def begin_drain(self) -> None:
        """Turn not-ready at once and refuse new work; accepted requests still finish."""
        self._draining = True
        for model in self.models.values():
            self.metrics.model_ready.labels(model.name).set(0)

    def busy(self) -> bool:
        """Whether any accepted request is still being answered."""
        return self._inflight > 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no accepted request is left (True) or the timeout passes (False)."""
        if self._inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def watch_workers(self, interval_s: float = 1.0) -> None:
        """Restart batch loops that died, so a crashed worker costs seconds, not the pod; with
        several server processes, also publish this one's device memory each interval."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_workers()
            self.metrics.sample_device_memory()

    async def check_workers(self) -> int:
        restarted = 0
        for model in self.models.values():
            if model.state is not State.READY or model.batcher is None or self._draining:
                continue
            if await model.batcher.restart_if_dead():
                restarted += 1
                self.metrics.batcher_restarts.labels(model.name).inc()
                logger.error("model %s: batch loop had died; restarted it", model.name)
        return restarted

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        self._draining = True
        for model in self.models.values():
            if model.batcher is not None:
                await model.batcher.stop(drain_timeout_s)
            self.metrics.model_ready.labels(model.name).set(0)
        self.metrics.workers_ready.set(0)
        self._threads.shutdown()

    # ------------------------------------------------------------------ health
    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    def ready(self) -> bool:
        """Ready when every model loaded and serves; a failed model keeps the server not ready."""
        return (
            self.loaded
            and not self._draining
            and not self.config_errors
            and all(m.ready for m in self.models.values())
        )

    # ------------------------------------------------------------------ inference
    def get(self, name: str, version: str | None = None) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"model {name!r} is not in the repository")
        if version is not None and version != model.version:
            raise ModelNotFound(f"model {name!r} has no version {version!r}")
        return model

    def validate(self, model: ServedModel, inputs: Mapping[str, np.ndarray]) -> None:
        """Names, datatypes, per-sample shapes and row counts against the model's config."""
        declared = {spec.name: spec for spec in model.config.inputs}
        unknown = sorted(set(inputs) - set(declared))
        if unknown:
            raise InvalidInput(
                f"unexpected input(s) {unknown} for model {model.name!r}; "
                f"expected {sorted(declared)}"
            )
        missing = sorted(set(declared) - set(inputs))
        if missing:
            raise InvalidInput(f"missing input(s) {missing} for model {model.name!r}")
        rows: set[int] = set()
        for name, array in inputs.items():
            spec = declared[name]
            actual = datatype_of(array)
            if actual != spec.datatype:
                raise InvalidInput(
                    f"input {name!r} has datatype {actual}; model {model.name!r} expects "
                    f"{spec.datatype}"
                )
            if array.ndim == 0 or not shape_matches(spec.shape, tuple(array.shape[1:])):
                raise InvalidInput(
                    f"input {name!r} has shape {list(array.shape)}; model {model.name!r} "
                    f"expects [-1, {', '.join(str(d) for d in spec.shape)}]".replace(", ]", "]")
                )
            rows.add(int(array.shape[0]))
            if spec.datatype == "BYTES":
                self._check_text_lengths(name, array)
        if len(rows) != 1:
            raise InvalidInput(f"inputs disagree on the batch dimension: {sorted(rows)}")
        if 0 in rows:
            raise InvalidInput("inputs have zero rows")
        if rows.pop() > self.settings.max_request_rows:
            raise LimitExceeded(
                f"request has more rows than the limit of {self.settings.max_request_rows} "
                "(NOGRAD_MAX_REQUEST_ROWS)"
            )

    def _check_text_lengths(self, name: str, array: np.ndarray) -> None:
        limit = self.settings.max_text_bytes
        longest = max((len(item) for item in array.reshape(-1)), default=0)
        if longest > limit:
            raise LimitExceeded(
                f"input {name!r} has an element of {longest} bytes; the limit is {limit} bytes "
                "(NOGRAD_MAX_TEXT_BYTES)"
            )

    async def infer(
        self,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout_s: float | None = None,
    ) -> tuple[ServedModel, Outputs]:
        """Validate, prepare and queue one request; ``timeout_s`` overrides the server default."""
        model = self.get(name, version)
        timeout = timeout_s if timeout_s is not None else self.settings.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        # Statistics extension: every request that names a served model counts, failed or not.
        stats = self.statistics.of(model.name)
        started = time.perf_counter()
        if self._inflight == 0 and self._cores is not None:
            self._cores.set_active(True)
        self._inflight += 1
        try:
            outputs = await self._infer(model, inputs, deadline)
        except BaseException as exc:
            stats.request_failed(time.perf_counter() - started)
            reason = _rejection_reason(exc)
            if reason is not None:
                self.metrics.rejected.labels(model.name, reason).inc()
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                if self._cores is not None:
                    self._cores.set_active(False)
                if self._idle is not None:
                    self._idle.set()
        stats.request_succeeded(len(next(iter(inputs.values()))), time.perf_counter() - started)
        return model, outputs

    async def _infer(
        self, model: ServedModel, inputs: Mapping[str, np.ndarray], deadline: float | None
    ) -> Outputs:
        name = model.name
        if self._draining:
            raise Draining(f"model {name!r} is not ready (server is draining)")
        if not model.ready or model.handler is None or model.batcher is None:
            raise ModelNotReady(f"model {name!r} is not ready ({self._why_not_ready(model)})")
        self.validate(model, inputs)
        try:
            if prepare_in_thread(model.handler, inputs):
                # Tokenising or decoding a large request costs milliseconds: off the event loop.
                part = await asyncio.to_thread(model.handler.prepare, inputs)
            else:
                part = model.handler.prepare(inputs)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        try:
            return await model.batcher.submit(part, deadline=deadline)
        except BatchingError:
            raise
        except Exception as exc:
            self.metrics.inference_errors.labels(name).inc()
            raise InferenceFailed(
                f"model {name!r} failed on this request: {type(exc).__name__}: {exc}"
            ) from exc

    def _why_not_ready(self, model: ServedModel) -> str:
        if self._draining:
            return "server is draining"
        if model.state is State.FAILED:
            return f"failed to load: {model.error}"
        if model.state is State.LOADING:
            return "still loading"
        return "inference worker is not running"

    # ------------------------------------------------------------------ metrics
    def _memory_readings(self) -> Iterable[tuple[str, int, int, int, int]]:
        devices = {
            device_label(m.handler.device): m.handler.device
            for m in self.models.values()
            if m.handler is not None
        }
        if not devices:
            devices = {"cpu": resolve_device("cpu")}
        for label, device in devices.items():
            reading = read_memory(device)
            yield label, reading.allocated, reading.reserved, reading.peak, reading.total


INLINE_PREPARE_BYTES = 4096
"""Text a heavy ``prepare`` may handle on the event loop: tokenising 4 KiB (about a thousand
tokens) takes under half a millisecond, less than the hand-off to a thread and back costs in a
busy server. minilm, one sentence per request at 32 concurrent: 125 -> 138 requests/s and p99
320 -> 277 ms (2 cores, six runs each, alternated)."""


def prepare_in_thread(handler: ModelHandler, inputs: Mapping[str, np.ndarray]) -> bool:
    """True when ``handler.prepare`` is heavy and this request's text exceeds the inline budget."""
    if not handler.prepare_offload:
        return False
    total = 0
    for array in inputs.values():
        # Text is counted value by value, stopping as soon as the budget is passed.
        sizes = (
            (len(v) if isinstance(v, (bytes, str)) else INLINE_PREPARE_BYTES for v in array.flat)
            if array.dtype == np.object_
            else (array.nbytes,)
        )
        for size in sizes:
            total += size
            if total > INLINE_PREPARE_BYTES:
                return True
    return False


def _rejection_reason(exc: BaseException) -> str | None:
    """The ``reason`` label of a request refused before (or instead of) compute."""
    if isinstance(exc, QueueFull):
        return "queue_full"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, (Draining, BatcherClosed)):
        return "draining"
    if isinstance(exc, (LimitExceeded, SampleTooLarge)):
        return "too_large"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return None


def settle_heap() -> None:
    """Move everything alive after loading into the collector's permanent generation.

    torch, transformers and the models leave millions of long-lived objects; every full
    collection walked all of them, and under load one came every few seconds and stopped the
    event loop for 130-280 ms (measured on digits at 32 concurrent requests), which was the whole
    p99. Frozen objects are never scanned again; what requests allocate is still collected.
    """
    gc.collect()
    gc.freeze()
