"""Models loaded on their first request and evicted by memory (``NOGRAD_MODEL_CONTROL=on_demand``).

A request for a model that is not resident holds it and waits for its one load (waiters share
it). Before a load, models are evicted least recently used first until the model's expected
bytes, then its load's expected height, fit in the limit; a model a request holds, or one asked
for within ``NOGRAD_EVICTION_GRACE_MS``, is never evicted, so a client cycling through cold
models slows its own loads rather than a model in steady use (it waits within the room wait,
then 503). At most ``NOGRAD_MAX_PENDING_LOADS`` loads are under way or waiting (503 past it); a
request whose deadline is shorter than its model's last load is refused at once (503). An
ensemble's request holds and loads its step models too. Each worker keeps a resident set of its
own within an equal part of the limit; docs/residency.md has the whole account.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from nograd.host.page_cache import keep_warm, model_files
from nograd.host.peak import SampledPeak
from nograd.host.readings import resident_bytes
from nograd.observability.metrics import Metrics
from nograd.runtime.devices import resolve_device
from nograd.runtime.engines.onnx import warm_onnx_runtime
from nograd.runtime.engines.onnx_mapped import map_weights, with_mapped_forms
from nograd.runtime.memory import device_budget, probe_for
from nograd.runtime.planner import warm_memory_probe
from nograd.serving.control.model_control import ModelControl
from nograd.serving.control.repository import files_bytes, find_source, holds_model
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import (
    InvalidInput,
    LoadFailed,
    LoadTooSlow,
    ModelNotFound,
    TooManyLoads,
)
from nograd.serving.registry import LOADING_ON_DEMAND, NOT_LOADED_YET, ServedModel
from nograd.serving.residency.background_profile import BackgroundProfiles
from nograd.serving.residency.on_disk import OnDisk
from nograd.serving.residency.policy import Residency, mib
from nograd.serving.residency.room import RoomForLoads
from nograd.settings import Settings

logger = logging.getLogger(__name__)

LOAD_SAMPLE_INTERVAL_S = 0.005
"""How often the resident memory is read while a load runs, for the load's peak."""


def process_limit(settings: Settings) -> int:
    """This worker's part of the memory limit: the operator's, or the share of free device
    memory the memory plan would budget (``memory_fraction``), split among the workers."""
    workers = settings.worker_count
    if settings.memory_limit_bytes is not None:
        return settings.memory_limit_bytes // workers
    probe = probe_for(resolve_device("auto"))
    return device_budget(probe, settings.memory_fraction / workers, None)


class OnDemand:
    """Loads models as requests ask for them and evicts by memory, in one worker process."""

    def __init__(self, control: ModelControl, plane: DataPlane, metrics: Metrics) -> None:
        settings = plane.settings
        self._control = control
        self._root = settings.model_repository
        self._store = plane.archive_store
        self._registry = plane.registry
        self._plane = plane
        self._metrics = metrics
        self._on_disk = OnDisk(self._root, self._store, self._registry)
        self.residency = Residency(
            process_limit(settings), grace_s=settings.eviction_grace_ms / 1e3
        )
        self._max_pending_loads = settings.max_pending_loads
        # Counted against a limit by its bytes, an ONNX model holds its weights once, mapped.
        map_weights(settings.engine_cache_dir / "mapped")
        self._counts_rss = resolve_device("auto").type == "cpu"
        """On CPU a model holds what its load added to the process's resident memory (an
        engine session, the file read beside it) when that is more than it measured."""
        self._loads: dict[str, asyncio.Task[None]] = {}
        """The load under way of each model: every request for it waits on this one."""
        self._load_started: dict[str, float] = {}
        """When each model's load under way began (``time.perf_counter``)."""
        self._lock = asyncio.Lock()
        """One load or eviction at a time: each decides on the resident set as it is."""
        self._failed: dict[str, tuple[tuple[str, ...], str]] = {}
        """Per model, the fingerprints of the files that failed to load and the error."""
        self._waiting: Counter[str] = Counter()
        """Holds of the requests waiting for a load (``ensure``), per model."""
        self._room = RoomForLoads(
            self.residency, settings.max_queue_wait_s, self._waiting, self._loads, self._evict
        )
        """Evictions for what a load brings in, waiting within the bound for held models."""
        self._warm_bytes = settings.warm_evicted_bytes
        self._warm: dict[str, list[tuple[Path, int]]] = {}
        """The files of the models evicted last (oldest first) kept in the page cache."""
        self._profiles = BackgroundProfiles(
            plane, self.residency, self._loads, self._lock, self._profile
        )
        """The models answering on an estimate of their memory, profiled when all is quiet."""

    def opened(self) -> None:
        """The start-up set (the pinned models) has loaded: count it, say how the others load,
        and pay at start-up what the first model's memory profile would otherwise bring in."""
        for name, reason in list(self._registry.unloaded.items()):
            if reason == "not loaded at start-up":
                self._registry.unloaded[name] = NOT_LOADED_YET
        self._follow_registry()
        warm_memory_probe()
        if any(self._root.rglob("*.onnx")):
            warm_onnx_runtime()
        message = "on-demand model control: memory limit %s in this worker, %d model(s) resident"
        logger.info(message, mib(self.residency.limit), len(self.residency.resident))

    def closed(self) -> None:
        """The server stops: ONNX files open as they are again in this process."""
        map_weights(None)

    @property
    def loading(self) -> frozenset[str]:
        """The models whose load is under way or waiting its turn in this worker."""
        return frozenset(self._loads)

    # ------------------------------------------------------------------ requests
    def hold(self, name: str) -> tuple[str, ...]:
        """A request for ``name`` arrived: neither it nor, for an ensemble, its step models are
        evicted until ``release`` of the names returned (the model first, then its steps)."""
        names = (name, *self._on_disk.steps(name))
        for each in names:
            self.residency.hold(each)
            self._count_holds(each)
        return names

    def release(self, names: tuple[str, ...]) -> None:
        freed = [self.residency.release(each) for each in names]
        for each in names:
            self._count_holds(each)
        if any(freed):
            self._room.look_again()

    def _count_holds(self, name: str) -> None:
        """Publish the requests holding ``name``, a model this worker loaded or loads: a name
        no model has gets no series of its own (it is answered 404)."""
        if name in self._loads or name in self.residency.measured:
            self._metrics.model_inflight.labels(name).set(self.residency.holds.get(name, 0))

    async def ensure(self, held: tuple[str, ...], time_left_s: float | None = None) -> None:
        """Return once the model ``hold`` returned ``held`` for is resident with its step
        models (at once when they are), loading each one that is not, steps first; a name the
        repository lacks is left to the lookup's 404. ``LoadTooSlow`` when the loads still to
        come are expected to take longer than ``time_left_s``, the request's deadline (the
        loads start all the same)."""
        order = (*held[1:], held[0])
        if time_left_s is not None:
            expected = sum(self._expected_load_s(name) for name in order)
            if expected > time_left_s:
                for name in order:
                    with contextlib.suppress(TooManyLoads):  # refused below all the same
                        self._start_load(name)
                raise LoadTooSlow(
                    f"model {held[0]!r} is not resident and loading it is expected to take "
                    f"{expected:.1f}s (its last load), more than the {max(time_left_s, 0):.1f}s "
                    "left of the request's deadline; it is loading: retry after that time",
                    retry_after_s=expected,
                )
        # While it waits, what it holds cannot be released: no load waits for it (below).
        self._waiting.update(held)
        try:
            for name in order:
                await self._ensure_one(name)
        finally:
            self._waiting.subtract(held)

    def _expected_load_s(self, name: str) -> float:
        """What is left of the load of ``name``: its last load's time, less what a load under
        way has run; 0 when resident or when no load of it was measured (then it is waited)."""
        model = self._registry.models.get(name)
        if model is not None and model.ready:
            return 0.0
        last = self.residency.load_seconds.get(name, 0.0)
        started = self._load_started.get(name)
        if started is not None and name in self._loads:
            return max(0.0, last - (time.perf_counter() - started))
        return last

    def _start_load(self, name: str) -> None:
        """Begin loading ``name`` unless resident or loading (``TooManyLoads`` past the cap)."""
        model = self._registry.models.get(name)
        if (model is not None and model.ready) or name in self._loads:
            return
        if not holds_model(self._root, name, self._store):
            return
        if len(self._loads) >= self._max_pending_loads:
            ahead = sum(self._expected_load_s(loading) for loading in self._loads)
            raise TooManyLoads(
                f"model {name!r} is not resident and {len(self._loads)} loads are under way or "
                f"waiting their turn in this worker, the most it takes "
                f"(NOGRAD_MAX_PENDING_LOADS); retry once they are done",
                retry_after_s=max(1.0, ahead),
            )
        task = asyncio.create_task(self._load(name), name=f"load-{name}")
        self._loads[name] = task
        self._room.look_again()  # a load waiting out a grace now stalls this one too
        self._metrics.model_loading.labels(name).set(1)
        self._count_holds(name)
        self._load_started[name] = time.perf_counter()
        task.add_done_callback(self._loaded)

    async def _ensure_one(self, name: str) -> None:
        model = self._registry.models.get(name)
        if model is not None and model.ready:
            return
        self._start_load(name)
        if name not in self._loads:
            return
        started = time.perf_counter()
        try:
            await asyncio.shield(self._loads[name])
        finally:
            self._metrics.load_wait.labels(name).observe(time.perf_counter() - started)

    def described(self, name: str, version: str | None) -> ServedModel | None:
        """A model that is not resident as its config on disk describes it (``OnDisk``)."""
        return self._on_disk.described(name, version)

    def _loaded(self, task: asyncio.Task[None]) -> None:
        """A load ended: the next request for its model starts anew (its waiters have the
        outcome; one whose waiters all left is still read, so it is not reported unread)."""
        name = task.get_name().removeprefix("load-")
        if self._loads.get(name) is task:
            del self._loads[name]
            self._profiles.load_ended()
            self._load_started.pop(name, None)
            self._metrics.model_loading.labels(name).set(0)
        if not task.cancelled():
            task.exception()

    # ------------------------------------------------------------------ loads
    async def _load(self, name: str) -> None:
        async with self._lock:
            model = self._registry.models.get(name)
            if model is not None and model.ready:
                return
            self._follow_registry()
            source = await asyncio.to_thread(find_source, self._root, self._store, name)
            prints = tuple(sorted(v.fingerprint for v in source.versions.values()))
            failed = self._failed.get(name)
            if failed is not None and failed[0] == prints:
                raise LoadFailed(failed[1])
            files = files_bytes(source)
            expected, peak_expected = self.residency.estimate(name, files)
            await self._room.make_room(name, expected)
            if self._counts_rss:
                await self._room.room_for_height(name, peak_expected)
            before = resident_bytes(os.getpid())
            self._registry.unloaded[name] = LOADING_ON_DEMAND
            started = time.perf_counter()
            try:
                with self._sampled() as sampled:
                    await self._control.apply({"op": "load", "name": name})
            except Exception as exc:
                self._failed[name] = (prints, str(exc))
                if self._registry.unloaded.get(name) == LOADING_ON_DEMAND:
                    self._registry.unloaded[name] = f"failed to load: {exc}"
                raise
            self._failed.pop(name, None)
            self._warm.pop(name, None)
            seconds = time.perf_counter() - started
            size = self._measured(name)
            after = resident_bytes(os.getpid())
            peak = held = 0
            outgrown = False  # it holds more than its weights: batches are planned again
            if self._counts_rss and before is not None and after is not None:
                # Its weights, or what its load added when more (engine sessions copy them).
                minimums = self._minimums(name)
                held = max(size - minimums, after - before)
                outgrown, size = held > size - minimums, held + minimums
                peak = max(sampled.highest, after) - before
            self.residency.admit(name, size, name in self._control.pinned, seconds, peak, files)
            self._count()
            self._metrics.model_loads.labels(name).inc()
            self._metrics.load_duration.labels(name).observe(seconds)
            logger.info(
                "model %s loaded on demand in %.2fs: holds %s, its load rose %s (expected %s); "
                "process resident memory %s -> %s",
                name,
                seconds,
                mib(size),
                mib(peak),
                mib(expected),
                mib(before or 0),
                mib(after or 0),
            )
            if size > expected:
                # Its first load held more than its files: make the room it really takes.
                try:
                    await self._room.make_room(name, size)
                except Exception:
                    await self._evict(name, "larger_than_limit")
                    raise
            if outgrown:  # once there is room for it, or the batches of all would share less
                self._record_held(name, held)
                self._plane.replan()
            self._profiles.profile_when_quiet(name)

    # ------------------------------------------------------------------ profiles
    async def _profile(self, name: str, stop: Callable[[], bool]) -> bool:
        """Profile ``name`` now (``BackgroundProfiles``) and count what it holds on the measured
        cost instead of the estimate (and what reopening its sessions added, if anything); False
        when ``stop`` stopped it (a load or a request arrived). Room is made for the height its
        fresh sessions rise to, as for a load."""
        entry = self.residency.resident[name]
        outside = entry.bytes - self._minimums(name)
        estimate = entry.bytes
        if self._counts_rss:
            await self._room.room_for_height(name, self.residency.estimate(name, entry.bytes)[1])
        before = resident_bytes(os.getpid())
        started = time.perf_counter()
        if not await self._plane.measure(name, stop):
            return False
        after = resident_bytes(os.getpid())
        if self._counts_rss and before is not None and after is not None:
            outside += max(0, after - before)
        size = outside + self._minimums(name)
        self.residency.resize(name, size)
        self._count()
        logger.info(
            "model %s: memory profile measured in %.2fs after it answered on an estimate: "
            "holds %s (%s on the estimate)",
            name,
            time.perf_counter() - started,
            mib(size),
            mib(estimate),
        )
        if size > estimate:
            try:
                await self._room.make_room(name, size)
            except Exception:
                logger.warning("model %s: no room for its measured memory", name, exc_info=True)
                await self._evict(name, "larger_than_limit")
        return True

    async def _evict(self, name: str, reason: str) -> bool:
        """Unload ``name`` unless a request took hold of it meanwhile; its memory is returned
        (``ModelLoader.free``) and its measured size kept for its next load."""
        before = resident_bytes(os.getpid())
        why = f"evicted ({'memory limit' if reason == 'memory' else 'larger than the limit'})"
        idle = self._idle if reason == "memory" else (lambda _: True)
        if not await self._control.evict(name, why, idle):
            return False
        self.residency.evicted(name)
        self._registry.unloaded[name] = why
        await self._keep_files_warm(name)
        self._metrics.model_evictions.labels(name, reason).inc()
        self._metrics.resident_bytes.labels(name).set(0)
        self._count()
        logger.info(
            "model %s %s; process resident memory %s -> %s",
            name,
            why,
            mib(before or 0),
            mib(resident_bytes(os.getpid()) or 0),
        )
        return True

    async def _keep_files_warm(self, evicted: str) -> None:
        """Keep the files of the models evicted last (up to ``warm_evicted_bytes``) in the page
        cache; only ``evicted``'s are advised now (the others were), and no load waits for it."""
        if self._warm_bytes <= 0:
            return
        try:
            # Off the event loop: reading its config again and listing its files would hold
            # the requests of the resident models for as long.
            files = await asyncio.to_thread(self._files_of, evicted)
        except (ModelNotFound, InvalidInput):
            return
        self._warm.pop(evicted, None)
        self._warm[evicted] = files
        while sum(size for files in self._warm.values() for _, size in files) > self._warm_bytes:
            del self._warm[next(iter(self._warm))]
        if evicted in self._warm:
            asyncio.get_running_loop().run_in_executor(None, keep_warm, [p for p, _ in files])

    def _files_of(self, name: str) -> list[tuple[Path, int]]:
        """The files of every version of ``name``, sizes included, and the forms they load."""
        source = find_source(self._root, self._store, name)
        return with_mapped_forms(model_files(v.directory for v in source.versions.values()))

    def _idle(self, name: str) -> bool:
        """Whether ``name``, chosen to make room (``Residency.victims``, which weighed its
        grace against the model coming in), is still idle: no request took hold of it since."""
        return not self.residency.held(name)

    # ------------------------------------------------------------------ accounting
    def _measured(self, name: str) -> int:
        """What ``name`` holds against the limit: each version's weights and smallest batch
        (its larger batches share what the resident models leave of the limit)."""
        versions = self._registry.versions.get(name, {}).values()
        return sum(model.weights_bytes for model in versions) + self._minimums(name)

    def _minimums(self, name: str) -> int:
        return sum(
            model.plan.minimum_bytes
            for model in self._registry.versions.get(name, {}).values()
            if model.plan is not None
        )

    def _record_held(self, name: str, held: int) -> None:
        """Recorded on the versions of ``name`` once the room for it is made (batches then share
        only what is left): sooner, the plan each eviction makes while making room would count
        it against a limit not yet cleared, and leave the models serving no batch."""
        versions = list(self._registry.versions.get(name, {}).values())
        for model in versions:
            model.resident_bytes = held // max(1, len(versions))

    def _sampled(self) -> contextlib.AbstractContextManager[SampledPeak]:
        """The process's resident memory sampled while a load runs (on CPU)."""
        pid = os.getpid()
        return SampledPeak(lambda: resident_bytes(pid) or 0, LOAD_SAMPLE_INTERVAL_S)

    def _follow_registry(self) -> None:
        """Count what load and unload calls changed: a model they loaded is resident, one they
        unloaded is not."""
        resident = self.residency.resident
        for name in list(resident):
            if name not in self._registry.versions:
                self.residency.evicted(name)
                self._metrics.resident_bytes.labels(name).set(0)
        for name, versions in self._registry.versions.items():
            if name not in resident and any(m.ready for m in versions.values()):
                pinned = name in self._control.pinned
                self.residency.admit(name, self._measured(name), pinned, 0.0)
                self._profiles.profile_when_quiet(name)  # loaded by a load call, on an estimate
        self._count()

    def _count(self) -> None:
        """Publish the resident set: how many, what each holds, the limit and the room left."""
        self._metrics.models_resident.set(len(self.residency.resident))
        self._metrics.memory_limit.set(self.residency.limit)
        self._metrics.memory_free.set(max(0, self.residency.limit - self.residency.used))
        for entry in self.residency.resident.values():
            self._metrics.resident_bytes.labels(entry.name).set(entry.bytes)
