"""The activation cost each loaded model is planned on: measured, recalled, or estimated first.

A model's memory profile runs fresh sessions at several batch sizes, seconds of work; a reload of
the same files reuses the one measured (in this process or in the engine cache). On demand, a
model loaded after start-up on CPU with none remembered is planned on an estimate from its
warm-up so its first request waits for its load only, and is profiled later (``measure``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nograd.runtime.devices import DeviceThreads, device_label
from nograd.runtime.engines.paths import serving_ranges
from nograd.runtime.memory import probe_for
from nograd.runtime.memory.cost import Point
from nograd.runtime.memory.fits import RangedCost
from nograd.runtime.planner import ProfileStopped, estimated_cost
from nograd.runtime.remembered_profile import is_remembered, profile_or_recall, remembered
from nograd.runtime.runners import Handler
from nograd.schema.config import ModelConfig
from nograd.serving.registry import ServedModel
from nograd.settings import Settings

logger = logging.getLogger(__name__)


def _profile_key(
    model: ServedModel, cap: int, handler: Handler | None = None
) -> tuple[object, ...]:
    """What a model's measured activation cost depends on: its files, its override, its device,
    its batch cap and the engines serving its batch sizes (of ``handler``, else its own)."""
    handler = handler or model.handler
    assert handler is not None
    engines = tuple((most, path.name) for most, path in serving_ranges(handler))
    device = device_label(handler.device)
    return (model.fingerprint, repr(model.override), device, cap, engines)


class MemoryProfiles:
    """The loader's memory profiles: those measured per version, the warm-up batches of the
    loads that estimate first, and the versions serving on an estimate until measured."""

    def __init__(
        self, settings: Settings, threads: DeviceThreads, limit: Callable[[ModelConfig], int]
    ) -> None:
        self._cache_dir = settings.engine_cache_dir
        self._threads = threads
        """The loader's device threads: a profile runs on its model's, as its batches do."""
        self._limit = limit
        """A model's configured batch limit: the cap its profile measures up to."""
        self._profiles: dict[tuple[str, str], tuple[tuple[object, ...], RangedCost]] = {}
        """Per model version, the activation cost last measured and what it was measured on:
        a reload of the same files on the same engines and device reuses it (an evicted model
        loads again without being profiled again)."""
        self.estimate_first = settings.model_control == "on_demand"
        """On demand, a model loaded after start-up on CPU with no profile remembered answers
        on an estimate (``estimated_cost``) and is profiled later (``measure``): a request
        waits for its load, not for its profile's sessions."""
        self._warmup_points: dict[int, list[Point]] = {}
        """By version (its id), its warm-up batches as measured (estimating loads only)."""
        self._unmeasured: dict[tuple[str, str], ServedModel] = {}
        """The versions serving on an estimate, by name and version, until ``measure``."""
        self._estimates: dict[tuple[str, str], tuple[tuple[object, ...], RangedCost]] = {}
        """Per model version, the estimate its warm-up gave and what it was measured on, kept
        until its profile is measured: a version evicted and loaded again before a quiet moment
        profiled it plans on the same estimate, and its warm-up measures nothing again."""

    def measured_before(self, model: ServedModel, handler: Handler, cap: int) -> bool:
        """Whether the cost of ``model`` as ``handler`` serves it was measured at an earlier
        load: by this process (evicted and loaded again on demand, profiled or estimated from
        its first warm-up) or by an earlier one, whose profile the engine cache remembers (the
        first load after a restart). Its plan is that measurement, so its warm-up need measure
        nothing and runs one round, as a reload's."""
        key = _profile_key(model, cap, handler)
        for kept in (self._profiles, self._estimates):
            known = kept.get((model.name, model.version))
            if known is not None and known[0] == key:
                return True
        return is_remembered(handler, model.loaded_as, self._cache_dir)

    def warmed_up(self, model: ServedModel, points: list[Point]) -> None:
        """Keep the batches an estimating load's warm-up measured, for its plan."""
        self._warmup_points[id(model)] = points

    async def profile(self, model: ServedModel) -> None:
        """Give a newly loaded ``model`` the activation cost its plan takes: the one measured on
        the same files, engines and device, else (a load that estimates first) the remembered
        or the estimated one, else one profiled now or recalled from the engine cache; a failed
        profile leaves none (its limit stays its config's)."""
        assert model.handler is not None
        loop = asyncio.get_running_loop()
        executor = self._threads.executor(model.handler.device)
        probe = probe_for(model.handler.device)
        cap = self._limit(model.config)
        measured_on = _profile_key(model, cap)
        known = self._profiles.get((model.name, model.version))
        points = self._warmup_points.pop(id(model), None)
        if known is not None and known[0] == measured_on:
            model.profile = known[1]
            return
        estimated = self._estimates.get((model.name, model.version))
        if estimated is not None and estimated[0] == measured_on and not points:
            model.profile = estimated[1]
            self._unmeasured[(model.name, model.version)] = model
            return
        if points is not None and await self._estimated(model, measured_on, points):
            return
        profiling = time.perf_counter()
        try:
            loaded_as, cache = model.loaded_as, self._cache_dir
            model.profile = await loop.run_in_executor(
                executor, profile_or_recall, model.handler, probe, cap, loaded_as, cache
            )
            self._profiles[(model.name, model.version)] = (measured_on, model.profile)
        except Exception:
            logger.exception(
                "memory profiling of model %s v%s failed; its limit stays at %d",
                model.name,
                model.version,
                cap,
            )
        model.phases["profile"] = time.perf_counter() - profiling

    async def _estimated(
        self, model: ServedModel, measured_on: tuple[object, ...], points: list[Point]
    ) -> bool:
        """Plan ``model`` on its remembered profile, else on the estimate its warm-up
        ``points`` give (``estimated_cost``), to be measured by ``measure``; False when neither
        is there (a token model: profiled now)."""
        assert model.handler is not None
        loop = asyncio.get_running_loop()
        executor = self._threads.executor(model.handler.device)
        cache = self._cache_dir
        known = await loop.run_in_executor(
            executor, remembered, model.handler, model.loaded_as, cache
        )
        if known is not None:
            model.profile = known
            self._profiles[(model.name, model.version)] = (measured_on, known)
            return True
        estimate = estimated_cost(model.handler, points)
        if estimate is None:
            return False
        model.profile = estimate
        self._unmeasured[(model.name, model.version)] = model
        self._estimates[(model.name, model.version)] = (measured_on, estimate)
        logger.info(
            "model %s v%s: planned on an estimate from its warm-up until its memory profile is "
            "measured",
            model.name,
            model.version,
        )
        return True

    def unmeasured(self, name: str) -> list[ServedModel]:
        """The versions of ``name`` serving on an estimate, not profiled yet."""
        return [m for (each, _), m in self._unmeasured.items() if each == name]

    async def measure(self, model: ServedModel, stop: Callable[[], bool]) -> bool:
        """Profile ``model``, serving on an estimate, on its device's thread and plan it on the
        measured cost (remembered for its next load; the loader plans its device again); False
        when it was not (no longer serving on an estimate, ``stop`` said so between two
        measurements, or the profile failed: then the estimate stays)."""
        key = (model.name, model.version)
        if self._unmeasured.get(key) is not model or model.handler is None:
            return False
        loop = asyncio.get_running_loop()
        executor = self._threads.executor(model.handler.device)
        probe = probe_for(model.handler.device)
        cap = self._limit(model.config)
        measured_on = _profile_key(model, cap)
        profiling = time.perf_counter()
        try:
            cost = await loop.run_in_executor(
                executor,
                profile_or_recall,
                model.handler,
                probe,
                cap,
                model.loaded_as,
                self._cache_dir,
                stop,
            )
        except ProfileStopped:
            return False
        except Exception:
            logger.exception(
                "memory profiling of model %s v%s failed; it stays planned on its estimate",
                model.name,
                model.version,
            )
            self._unmeasured.pop(key, None)
            return False
        if self._unmeasured.get(key) is not model or model.handler is None:
            return False  # freed while it was measured
        del self._unmeasured[key]
        self._estimates.pop(key, None)
        model.profile = cost
        model.phases["profile"] = time.perf_counter() - profiling
        self._profiles[key] = (measured_on, cost)
        return True

    def forget(self, model: ServedModel) -> None:
        """A version is freed: its warm-up batches go, and it no longer waits to be measured."""
        self._warmup_points.pop(id(model), None)
        if self._unmeasured.get((model.name, model.version)) is model:
            del self._unmeasured[(model.name, model.version)]
