"""Loading the repository's models: build, speed mode, warm-up, memory plan, then the batchers.

The start-up set loads on the thread that will run its batches: torch's OpenMP threads belong
to the thread that first ran a parallel op (a second team kept by a loading thread slowed every
later forward), and on a GPU the current stream and the graphs captured during warm-up belong to
it too. A later load on CPU runs on a thread of its own that ends with it, beside the batches of
the models serving, rather than ahead of them on their thread (:meth:`ModelLoader._build`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Final

import torch

from nograd.batching import Batcher, BatchLimit
from nograd.formats.table import format_warmup
from nograd.formats.torchserve.reading.archives import hold, origin, release
from nograd.host.heap import release_free_memory
from nograd.host.ledger import CoreShare
from nograd.observability.metrics import Metrics
from nograd.observability.stats import FanOutObserver, Statistics
from nograd.runtime.devices import device_label, resolve_device
from nograd.runtime.engines.choice import prepare_engine
from nograd.runtime.engines.paths import engine_weights_bytes, share_cores
from nograd.runtime.engines.remembered import keyed, model_digest
from nograd.runtime.handler import ModelHandler, Outputs, TensorPart
from nograd.runtime.loader import (
    build_handler,
    forget_module,
    locate,
    module_name,
)
from nograd.runtime.memory import ProcessPeakProbe, probe_for
from nograd.runtime.memory.fits import RangedCost
from nograd.runtime.planner import PlanInput, log_plan, plan_device
from nograd.runtime.runners import Handler, batch_runner, loop_thread_runner
from nograd.runtime.speed.path import batch_cap
from nograd.runtime.warmup import warm_up
from nograd.schema.config import ConfigError, ModelConfig
from nograd.serving.calls.precedence import effective_config
from nograd.serving.calls.trace_stamps import TracedRunner
from nograd.serving.control.profiles import MemoryProfiles
from nograd.serving.control.shares import DeviceShares
from nograd.serving.control.uploads import repository_of
from nograd.serving.extensions.speed_checks import load_accuracy_sample, recorder
from nograd.serving.registry import ServedModel, State
from nograd.serving.residency.frozen_heap import (
    collect_freed,
    freezes,
    frozen_since,
    settle_heap,
    settle_new_libraries,
    still_alive,
)
from nograd.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS: Final = 16384
"""A token model's batch limit before its memory is planned, when its config sets none."""


def configured_limit(config: ModelConfig, default_rows: int) -> int:
    """A model's batch limit from its config (samples, or padded tokens for token models): the
    cap memory planning starts from, and the limit when planning is not possible."""
    if config.batch_unit == "tokens":
        return config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    return config.max_batch_size or default_rows


class ModelLoader:
    """Brings every model of the registry from its config to a running batcher."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        statistics: Statistics,
        cores: CoreShare | None = None,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._statistics = statistics
        self.shares = DeviceShares(settings, cores)
        """The device threads, and what each batch may take of its device."""
        self.threads = self.shares.threads
        self._joined = False
        self._unpacked: dict[int, Path] = {}
        """By version (its id), the unpacked archive it holds (``archives.hold``)."""
        self._plan_level = logging.DEBUG  # at start-up, the ready summary shows the plan
        self.profiles = MemoryProfiles(settings, self.threads, self._limit)
        """The activation costs the models are planned on (measured, recalled or estimated)."""

    def _limit(self, config: ModelConfig) -> int:
        return configured_limit(config, self._settings.max_batch_size)

    async def load_all(
        self, models: list[ServedModel], serving: Sequence[ServedModel] = ()
    ) -> None:
        """Load and warm up every model, plan memory per device (with the ``serving`` ones,
        whose shares change), then start the batchers. Planning waits for every load so the
        free memory it budgets already excludes all weights; a model that fails at any step is
        reported and left not ready."""
        started_up = self._joined
        if not self._joined:
            self._joined = True
            self.shares.join_cores()
        for model in models:
            try:
                device = resolve_device(model.config.device)
                model.heap_mark = freezes()
                estimate = started_up and self.profiles.estimate_first and device.type == "cpu"
                await self.threads.run_load(
                    device, partial(self._load, model, device, estimate), beside_batches=started_up
                )
            except Exception as exc:
                _failed(model, exc, "failed to load")
        await self._plan_memory(models, serving)
        for model in models:
            if model.handler is not None and model.state is State.LOADING:
                try:
                    await self._start(model)
                except Exception as exc:
                    _failed(model, exc, "failed to start")
        self._plan_level = logging.INFO
        if started_up:
            settle_new_libraries()
        else:
            settle_heap()

    def _load(self, model: ServedModel, device: torch.device, estimate: bool = False) -> None:
        workers = self._settings.worker_count
        if model.config.sequence is not None and workers > 1:
            raise ConfigError(
                f"model '{model.name}' declares sequence_batching, which nograd serves with one "
                f"worker only (NOGRAD_WORKERS=1; it is {workers}): each worker keeps its own "
                "sequences, and a sequence's requests may reach any worker"
            )
        # The loaded handler's config (``model.config`` below) holds the values served with.
        config = effective_config(model.config, self._settings)
        started = time.perf_counter()
        previous = sys.modules.get(module_name(config))
        if origin(model.directory) is not None and id(model) not in self._unpacked:
            self._unpacked[id(model)] = hold(model.directory)  # unpacked at load, not at read
        try:
            repository = repository_of(self._settings.model_repository, model.directory)
            handler = build_handler(repository, model.directory, config, device)
        finally:
            # Kept even when the build fails, so freeing the version takes its code out too.
            imported = sys.modules.get(module_name(config))
            if imported is not previous:
                model.code = imported
        model.phases["build"] = time.perf_counter() - started
        # An artifact's signature may have filled in the inputs and outputs.
        model.config = config = handler.config
        if model.format.warmup is not None:
            # The format's own warm-up (Triton's model_warmup), on the model as its backend runs
            # it; a failure fails the load.
            started_warmup = time.perf_counter()
            format_warmup(model.format.warmup)(handler, model.directory)
            model.warmup_seconds = time.perf_counter() - started_warmup
        # The engine (and the config's speed mode), checked against fp32 eager and timed; what
        # is refused leaves fp32 eager serving. Counted as load time.
        if isinstance(handler, ModelHandler) and handler.synthetic_inputs:
            sample = load_accuracy_sample(handler, model.directory)
            choosing = time.perf_counter()
            code = _model_files(model.directory, config)
            # Its weights hashed once: the profile's and the engine choice's keys derive from it.
            cache = self._settings.engine_cache_dir
            digest = model_digest(handler, self._limit(config), code, cache)
            model.loaded_as = keyed(digest, ())
            handler = prepare_engine(
                handler,
                self._limit(config),
                sample,
                recorder(self._metrics),
                code=code,
                cache_dir=self._settings.engine_cache_dir,
                digest=digest,
            )
            model.phases["engines"] = time.perf_counter() - choosing
        if self.shares.widths:
            # Each batch is granted a width; ONNX Runtime's pool is fixed per session.
            share_cores(handler.speed_path, self.shares.widths)
        model.load_seconds = time.perf_counter() - started
        self._metrics.model_load.labels(model.name).set(model.load_seconds)
        model.weights_bytes = handler.weights_bytes + engine_weights_bytes(handler.speed_path)
        self._metrics.weights_bytes.labels(model.name).set(model.weights_bytes)
        if self._settings.warmup and handler.synthetic_inputs:
            started = time.perf_counter()
            # Measured as it runs when the model is to answer before its profile: the estimate
            # it is planned on until then (one reading per batch, no fresh session); not when its
            # cost was measured before (by this process, or remembered in the engine cache across
            # a restart). One round pays every shape's lazy set-up; a second runs only to be
            # measured without that set-up in it.
            again = estimate and self.profiles.measured_before(model, handler, self._limit(config))
            probe = ProcessPeakProbe(runs=1) if estimate and not again else None
            points = warm_up(handler, self._limit(config), 1 if probe is None else 2, probe)
            if estimate:
                self.profiles.warmed_up(model, points)
            model.warmup_seconds += time.perf_counter() - started
            self._metrics.model_warmup.labels(model.name).set(model.warmup_seconds)
        model.handler = handler
        logger.info(
            "model %s v%s loaded on %s in %.2fs, warmed up in %.2fs",
            model.name,
            model.version,
            device_label(device),
            model.load_seconds,
            model.warmup_seconds,
        )

    async def _plan_memory(
        self, models: list[ServedModel], serving: Sequence[ServedModel] = ()
    ) -> None:
        """Measure each newly loaded model's activation cost, then split each device's budget
        among those and the ``serving`` ones (whose limits change with their new shares)."""
        fresh = [
            m
            for m in models
            if m.handler is not None and m.handler.synthetic_inputs and m.state is State.LOADING
        ]
        for model in fresh:
            assert model.handler is not None
            if not model.handler.synthetic_inputs:
                continue  # no plan: its limit is its config's (``ModelHandler.synthetic_inputs``)
            await self.profiles.profile(model)
        if fresh:
            self._plan_devices(fresh, [m for m in serving if m.ready])

    async def measure(
        self, name: str, served: Callable[[], Sequence[ServedModel]], stop: Callable[[], bool]
    ) -> bool:
        """Profile the versions of ``name`` serving on an estimate (``MemoryProfiles.measure``)
        and plan each one's device again, among the ``served`` ones, on what was measured; False
        when one was not measured (``stop`` said so between two measurements, or it failed)."""
        measured = []
        for model in self.profiles.unmeasured(name):
            serving = served()
            measured.append(await self.profiles.measure(model, stop))
            if measured[-1]:
                self._plan_devices([], [m for m in serving if m.ready])
        return all(measured)

    def replan(self, serving: Sequence[ServedModel]) -> None:
        """Split each device's budget again among the models left serving (after an unload)."""
        self._plan_devices([], [m for m in serving if m.ready])

    def _plan_devices(self, fresh: list[ServedModel], others: list[ServedModel]) -> None:
        by_device: dict[str, list[ServedModel]] = {}
        for model in [*others, *fresh]:
            if model.handler is not None and model.profile is not None:
                by_device.setdefault(device_label(model.handler.device), []).append(model)
        for label, group in by_device.items():
            assert group[0].handler is not None
            probe = probe_for(group[0].handler.device)
            names = [m.name for m in group]
            keyed = {
                (m.name if names.count(m.name) == 1 else f"{m.name} v{m.version}"): m for m in group
            }
            inputs = []
            profiles: dict[str, RangedCost] = {}
            for key, model in keyed.items():
                assert model.handler is not None and model.profile is not None
                profiles[key] = model.profile
                cap = self._limit(model.config)
                inputs.append(PlanInput(key, model.handler, model.weights_bytes, cap))
            budget, plans = plan_device(
                inputs,
                profiles,
                probe,
                fraction=self._settings.memory_fraction / self._settings.worker_count,
                explicit_bytes=self.shares.budget(label, group),
            )
            # The device's whole budget: each batch this process runs at once has its part.
            self._metrics.memory_budget.labels(label).set(budget * self.shares.at_once(label))
            log_plan(label, budget, plans, self._plan_level)
            for plan in plans:
                model = keyed[plan.name]
                model.plan = plan
                self._metrics.sample_bytes.labels(model.name).set(plan.unit_bytes)
                self._metrics.memory_fits(model.name, plan.fit_rows())
                if model.batcher is not None and model.handler is not None:
                    model.batcher.limit.remeasure(plan.limit)
                    model.batcher.limit.set_cap(batch_cap(model.handler))

    async def free(self, model: ServedModel) -> None:
        """Drop an unloaded (or failed) version's model, batcher and code and hand its memory
        back: its objects to the collector (the whole heap only if it was frozen with the rest,
        :mod:`nograd.serving.residency.frozen_heap`), the device's cached blocks and the C heap's
        free pages.

        The collection runs on the device's thread, after whatever ran there before: that
        thread holds the version's last batch (its finished work item, the batcher and so the
        handler) a moment after the batch answered, until it takes its next work. Collected
        then, a handler in a cycle would stay reachable and, were the heap frozen again, never
        be freed.
        """
        handler, model.handler, model.batcher = model.handler, None, None
        code, model.code = model.code, None
        self.profiles.forget(model)
        frozen = (handler is not None or code is not None) and frozen_since(model.heap_mark)
        model.state = State.UNLOADED
        device = handler.device if handler is not None else None
        executor = self.threads.executor(device) if device is not None else None
        # What the version alone owns, watched before its clean-up lets any of it go.
        owned = (getattr(handler, part, None) for part in ("module", "speed_path"))
        alive = still_alive(handler, code, *owned)
        if handler is not None:
            await asyncio.get_running_loop().run_in_executor(executor, _close, model, handler)
        del handler
        if code is not None:
            forget_module(code)
        del code
        await asyncio.get_running_loop().run_in_executor(
            executor, release_memory, device, frozen, alive
        )
        if (unpacked := self._unpacked.pop(id(model), None)) is not None:
            await asyncio.get_running_loop().run_in_executor(None, release, unpacked)

    async def _start(self, model: ServedModel) -> None:
        assert model.handler is not None
        config = model.config
        observer = self._metrics.observer(model.name)
        if model.plan is not None:
            limit = BatchLimit(model.plan.limit)
            observer.predict_bytes = model.plan.predict_bytes
        else:
            limit = BatchLimit(self._limit(config))
        # Fixed shapes: a batch above the largest bucket would run as several forwards, every
        # caller waiting for all of them; capped, the later callers form the next batch instead.
        limit.set_cap(batch_cap(model.handler))
        delay_ms = config.max_queue_delay_ms
        running, staged = self.shares.batches(model)
        runner = batch_runner(model.handler, self.shares.cores)
        loop_batch_s = self._settings.max_loop_batch_s
        on_loop = loop_thread_runner(runner) if loop_batch_s > 0 else None
        batcher: Batcher[TensorPart, Outputs] = Batcher(
            model.name,
            TracedRunner(runner),
            self.threads.executor(model.handler.device),
            limit,
            max_queue_delay_s=(self._settings.max_queue_delay_ms if delay_ms is None else delay_ms)
            / 1000.0,
            max_queue_size=config.max_queue_size or self._settings.max_queue_size,
            unit_tokens=config.batch_unit == "tokens",
            observer=FanOutObserver(observer, self._statistics.observer(model.name)),
            # Requests with different sets of optional inputs never share a batch (Triton's).
            group_of=input_names if any(spec.optional for spec in config.inputs) else None,
            max_running_batches=running,
            max_staged_batches=staged,
            loop_runner=None if on_loop is None else TracedRunner(on_loop),
            max_loop_batch_s=loop_batch_s,
        )
        await batcher.start()
        observer.limit_changed(limit.current)
        model.batcher = batcher
        model.state = State.READY
        self._metrics.model_ready.labels(model.name).set(1)


def input_names(part: TensorPart) -> frozenset[str]:
    """The inputs a request carries: its batch group when the model has optional inputs."""
    return frozenset(part.tensors)


def release_memory(
    device: torch.device | None, frozen: bool, alive: Callable[[], bool] = lambda: True
) -> None:
    """Collect what a freed model left (the whole heap when some of it was ``frozen`` and is
    ``alive`` still, :func:`nograd.serving.residency.frozen_heap.collect_freed`), then return
    the device's cached blocks and the C heap's free pages; off the event loop (the heap's
    release locks each arena while it walks it)."""
    collect_freed(frozen, alive)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    release_free_memory()


def _close(model: ServedModel, handler: Handler) -> None:
    """The model's own clean-up (Triton's ``finalize``); its failure is logged, not raised."""
    try:
        handler.close()
    except Exception:
        logger.exception("model %s v%s: finalize failed", model.name, model.version)


def _failed(model: ServedModel, exc: Exception, what: str) -> None:
    model.state = State.FAILED
    model.error = f"{what}: {exc}"
    logger.exception("model %s %s", model.name, what)


def _model_files(model_dir: Path, config: ModelConfig) -> list[Path]:
    """What an engine built from the model depends on besides its weights: its code, and the
    TorchScript file it is built from (its graph is not in its weights)."""
    files = [locate(model_dir, config.module)]
    if config.artifact is not None:
        files.append(locate(model_dir, config.artifact))
    return files
