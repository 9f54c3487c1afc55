"""Model control: loading, reloading and unloading models while serving
(``NOGRAD_MODEL_CONTROL``).

A load builds, warms up and memory-plans the new versions while the old ones serve; traffic
switches once they are ready, and the versions they replace drain their accepted requests before
they are freed. Unchanged versions (same files, same config) are left alone. With several workers
a call is applied by every worker before it answers, one call at a time server-wide: the worker
that takes it applies it, records what it then serves of that model (versions and overrides) in
the state the workers share, and every sibling makes itself serve that state; a worker that
starts later (a restart after a crash) loads that state before it takes connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nograd.schema.config import ModelConfig, check_model_name, version_order
from nograd.serving.control.peers import Peers, Served
from nograd.serving.control.repository import (
    ModelSource,
    Override,
    always_resident,
    find_source,
    folder_gone,
    holds_model,
    repository_names,
    scan,
)
from nograd.serving.control.uploads import Uploads
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import ControlRefused, InvalidInput, LoadFailed, ModelNotFound
from nograd.serving.extensions.ensembles import composing, step_models, used_by_ensemble
from nograd.serving.registry import ServedModel

logger = logging.getLogger(__name__)


class ModelControl:
    """Applies load and unload calls and repository changes to the data plane."""

    def __init__(self, plane: DataPlane, shared_dir: Path | None = None) -> None:
        """``shared_dir``: the folder this worker shares with its siblings (None: one process)."""
        self._plane = plane
        self._settings = plane.settings
        self.peers = None if shared_dir is None else Peers(shared_dir, self.apply_from_peer)
        self.uploads = Uploads.shared(shared_dir, self._settings)
        self._lock = asyncio.Lock()
        self._started = asyncio.Event()
        """Set once the start-up set has loaded: a sibling's sync waits for it."""
        self._failed: dict[tuple[str, str], str] = {}
        """Poll mode: the fingerprint of each version that failed to load, not retried unchanged."""
        self._problems: set[str] = set()
        self._explicit: set[str] = set()
        """Models a load call named: ``unload_dependents`` leaves them loaded, as in Triton."""
        self._touched: set[str] = set()
        """What the call being applied loaded or unloaded, step models included (for siblings)."""
        self.pinned: set[str] = set()
        """On demand: the models always resident (``load_models``, ``resident = "always"``)."""

    @property
    def mode(self) -> str:
        return self._settings.model_control

    @property
    def root(self) -> Path:
        return self._settings.model_repository

    # ------------------------------------------------------------------ start-up
    async def open(self) -> None:
        """Join the sibling workers' control channel before reading what to load, so a call made
        while this worker starts is applied after its start-up load, not lost."""
        if self.peers is not None:
            await self.peers.start()

    async def close(self) -> None:
        if self.peers is not None:
            await self.peers.stop()
        self.uploads.close()

    def discover(self) -> None:
        """Read the repository and register the start-up set: every model (``none``, ``poll``),
        or (``explicit``) what the workers serve as the last control call recorded it, versions
        and overrides included, and ``load_models`` before any call."""
        if self.mode == "on_demand":
            sources, _ = scan(self.root, None, self._plane.archive_store)
            self.pinned = always_resident(sources, self._settings.load_model_names)
            self._plane.discover(self.pinned.__contains__)
        elif self.mode != "explicit":
            self._plane.discover()
        elif (recorded := self._recorded()) is not None:
            # A worker started after control calls (a restart) serves what its siblings serve:
            # the same versions, with the same overrides.
            self._plane.discover(recorded.__contains__, recorded)
            for version in self.uploads.recorded(recorded, self._find):
                self._plane.registry.add(ServedModel.of(version))
        else:
            names = self._settings.load_model_names
            self._plane.discover(None if names is None else names.__contains__)
            self._explicit = set(self._plane.registry.versions if names is None else names)
        if self.mode != "none":
            # Only a fixed repository must be whole to serve: under control, an unreadable
            # folder is logged and listed, and the models that load serve.
            self._problems = set(self._plane.registry.config_errors)
            self._plane.registry.config_errors.clear()

    async def load_startup(self) -> None:
        try:
            async with self._lock:
                await self._plane.load_all()
        finally:
            self._started.set()

    # ------------------------------------------------------------------ calls
    async def load(
        self, name: str, override: Override | None = None, files: str | None = None
    ) -> None:
        """Load ``name`` (or reload what changed of it) on every worker (``files``: see
        ``Uploads.placed``)."""
        await self._everywhere({"op": "load", "name": name, "override": override, "files": files})

    async def unload(self, name: str, dependents: bool = False) -> None:
        """Unload every version of ``name`` on every worker; accepted requests finish first.
        ``dependents``: the step models it brought too (Triton's ``unload_dependents``)."""
        await self._everywhere({"op": "unload", "name": name, "dependents": dependents})
        self.uploads.remove(name)

    async def _everywhere(self, call: dict[str, Any]) -> None:
        # A name no model can have is refused before it reaches the repository or a sibling.
        name = call["name"]
        try:
            check_model_name(name)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        if self.mode not in ("explicit", "on_demand"):
            if name not in self._plane.registry.versions and not self._in_repository(name):
                raise ModelNotFound(f"model {name!r} is not in the repository")
            setting = "NOGRAD_MODEL_CONTROL"
            if self.mode == "poll":
                raise ControlRefused(
                    f"model control is 'poll' ({setting}): models load and unload as the "
                    "repository changes; load and unload calls are refused"
                )
            raise ControlRefused(
                f"model control is not enabled ({setting}=none): every model loads at start-up "
                f"and a restart applies changes; set {setting}=explicit for load and unload calls"
            )
        if self.peers is None:
            await self.apply(call)
            return
        if self.mode == "on_demand":
            # Each worker keeps a resident set of its own: the call itself reaches each one.
            await self.apply(call)
            failures = await self.peers.broadcast(call)
            if failures:
                detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
                raise LoadFailed(f"applied by this worker, but not by every worker: {detail}")
            return
        async with self.peers.exclusive():
            recorded = self._recorded()
            if recorded is None:
                recorded = self._plane.registry.overrides()
            else:
                await self._sync_logged()
            failed: LoadFailed | None = None
            try:
                await self.apply(call)
            except LoadFailed as exc:
                failed = exc  # a version that did load serves: the siblings must serve it too
            # What serves of the models after the call, not what the call asked: the name and
            # versions the repository gave, each with its override, whatever the call named
            # (an ensemble's step models loaded or unloaded with it too).
            now = self._plane.registry.overrides()
            for touched in {name, *self._touched}:
                served = now.get(touched)
                if served:
                    recorded[touched] = served
                else:
                    recorded.pop(touched, None)
            self.peers.write_state(recorded)
            failures = await self.peers.broadcast({"op": "sync"})
        if failures:
            detail = "; ".join(f"{worker}: {error}" for worker, error in sorted(failures.items()))
            prefix = f"{failed}; " if failed is not None else ""
            raise LoadFailed(f"{prefix}applied by this worker, but not by every worker: {detail}")
        if failed is not None:
            raise failed

    def _recorded(self) -> Served | None:
        return self.peers.read_state() if self.peers is not None else None

    async def _sync(self) -> list[str]:
        """Serve what the shared state records: unload the models it leaves out, load the
        versions it names that are missing or differ (a version that already failed with the
        same files and override is not tried again). The problems, one per model."""
        recorded = self._recorded()
        if recorded is None:
            return []
        registry = self._plane.registry
        problems: list[str] = []
        loads: list[ModelSource] = []
        for name in sorted(set(registry.versions) | set(recorded)):
            versions = recorded.get(name)
            try:
                if versions is None:
                    await self._unload(name)
                    continue
                source = await asyncio.to_thread(self._find, name, None, versions)
                if self._changed(name, source):
                    loads.append(source)
            except (ModelNotFound, InvalidInput) as exc:
                problems.append(str(exc))
        # Ensembles after the models (their step models load first, as on the calling worker).
        loads.sort(key=lambda source: any(v.config.steps for v in source.versions.values()))
        for source in loads:
            try:
                await self._reconcile(source.name, source)
            except LoadFailed as exc:
                problems.append(str(exc))
        return problems

    async def _sync_logged(self) -> None:
        async with self._lock:
            for problem in await self._sync():
                logger.error("model control: not served as the other workers serve it: %s", problem)

    async def apply(self, call: dict[str, Any]) -> None:
        """Apply one load or unload call in this worker."""
        name = str(call["name"])
        async with self._lock:
            self._touched = set()
            if call["op"] == "unload":
                registry = self._plane.registry
                steps = step_models(registry, name) if call.get("dependents") else []
                await self._unload(name)
                self._explicit.discard(name)
                self._touched.add(name)
                for step in reversed(steps):
                    if step not in self._explicit and not used_by_ensemble(registry, step):
                        await self._unload(step)
                        self._touched.add(step)
                return
            override = call.get("override")
            if override is not None and not isinstance(override, dict):
                raise InvalidInput("the config override must be a JSON object of config fields")
            files, registry = call.get("files"), self._plane.registry
            async with self.uploads.placed(name, files, registry, self._in_repository):
                source = await asyncio.to_thread(self._find, name, override)  # configs parse slowly
                registry.check_cap(name, len(source.versions), self._settings.max_loaded_models)
                await self._load_steps(source)
                self._explicit.add(name)
                await self._reconcile(name, source)

    async def _load_steps(self, source: ModelSource) -> None:
        """Load an ensemble's step models (nested ones' first) not loaded or changed on disk, as
        Triton does; one that fails fails the ensemble, whose check names it."""
        configs = [v.config for v in source.versions.values()]
        for step in composing(configs, {source.name}, self._configs_on_disk):
            try:
                step_source = self._find(step)
                if step in self._plane.registry.versions and not self._changed(step, step_source):
                    continue
                self._touched.add(step)
                await self._reconcile(step, step_source)
            except (ModelNotFound, InvalidInput, LoadFailed) as exc:
                logger.error("ensemble %s: step model %s did not load: %s", source.name, step, exc)
                if step not in self._plane.registry.versions and self._in_repository(step):
                    self._plane.registry.unloaded[step] = f"failed to load: {exc}"

    def _configs_on_disk(self, name: str) -> list[ModelConfig] | None:
        try:
            return [v.config for v in self._find(name).versions.values()]
        except (ModelNotFound, InvalidInput):
            return None

    async def apply_from_peer(self, call: dict[str, Any]) -> str | None:
        """A sibling's ``sync``, once this worker's start-up set has loaded: the problems as
        text, or None."""
        await self._started.wait()
        if self.mode == "on_demand" and call.get("op") in ("load", "unload"):
            try:
                await self.apply(call)
            except (LoadFailed, ModelNotFound, InvalidInput, ControlRefused) as exc:
                return str(exc)
            return None
        if call.get("op") != "sync":
            return f"unknown control call {call.get('op')!r}"
        async with self._lock:
            problems = await self._sync()
        return "; ".join(problems) or None

    def _find(
        self,
        name: str,
        override: Override | None = None,
        wanted: dict[str, Override | None] | None = None,
    ) -> ModelSource:
        root = self.uploads.folder if self.uploads.holds(name) else self.root
        return find_source(root, self._plane.archive_store, name, override, wanted)

    async def _unload(self, name: str) -> None:
        registry = self._plane.registry
        served = list(registry.versions.get(name, {}).values())
        if not served:
            if name in registry.unloaded or self._in_repository(name):
                return  # already unloaded: nothing to do, as Triton answers
            raise ModelNotFound(f"model {name!r} is not in the repository")
        for model in served:
            await self._retire(model, "unloaded by request")
        self._plane.replan()

    async def evict(self, name: str, reason: str, idle: Callable[[str], bool]) -> bool:
        """Unload every version of ``name`` (on demand, to make room) unless ``idle(name)`` no
        longer holds once no other change is under way: taken out of the registry at once, so
        no request finds it from then on. False when nothing was evicted."""
        async with self._lock:
            registry = self._plane.registry
            served = list(registry.versions.get(name, {}).values())
            if not served or not idle(name):
                return False
            for model in served:
                registry.remove(model, reason)
            for model in served:
                await self._retire(model, reason)
            self._plane.replan()
            return True

    def _in_repository(self, name: str) -> bool:
        return holds_model(self.root, name, self._plane.archive_store)

    async def _reconcile(self, name: str, source: ModelSource | None) -> None:
        """Make the versions of ``name`` that serve those of ``source`` (None: none): load the
        new and changed ones, switch to them once ready, then retire what they replace."""
        registry = self._plane.registry
        current = dict(registry.versions.get(name, {}))
        wanted = source.versions if source is not None else {}
        fresh = [
            ServedModel.of(v)
            for version, v in wanted.items()
            if version not in current
            or current[version].fingerprint != v.fingerprint
            or not current[version].ready
        ]
        if fresh:
            await self._plane.load_models(fresh)
        failed = [m for m in fresh if not m.ready]
        for model in fresh:
            if model.ready:
                registry.add(model)
        now = registry.versions.get(name, {})
        # A version that failed to load replaces nothing: what served before serves on.
        reason = "removed from the repository" if source is None else "no longer selected"
        gone = [
            (m, "replaced by a newer load" if now.get(v) is not m else reason)
            for v, m in current.items()
            if now.get(v) is not m or (v not in wanted and not failed)
        ]
        for model, why in gone:
            await self._retire(model, why)
        if gone:
            self._plane.replan()
        for model in failed:
            self._failed[(name, model.version)] = model.fingerprint
            await self._plane.free(model)
        if failed:
            detail = "; ".join(f"version {m.version}: {m.error}" for m in failed)
            if name not in registry.versions:
                registry.unloaded[name] = f"failed to load: {detail}"
            raise LoadFailed(f"model {name!r} did not load: {detail}")
        if fresh:
            loaded = ", ".join(sorted((m.version for m in fresh), key=version_order))
            logger.info("model %s: version(s) %s serving", name, loaded)
            self._plane.recheck_ensembles(name)

    async def _retire(self, model: ServedModel, reason: str) -> None:
        """Stop routing to ``model``, let the requests that hold it finish, then free it."""
        registry = self._plane.registry
        registry.remove(model, reason)
        deadline = time.monotonic() + self._settings.drain_timeout_s
        await model.all_let_go(self._settings.drain_timeout_s)
        if model.batcher is not None:
            await model.batcher.stop(max(0.0, deadline - time.monotonic()))
        self._plane.mark_ready(model.name)
        logger.info("model %s v%s unloaded (%s)", model.name, model.version, reason)
        await self._plane.free(model)

    # ------------------------------------------------------------------ index
    def index(self) -> list[ServedModel | tuple[str, str]]:
        """The repository index's rows (``ModelRegistry.index``), archives included."""
        return self._plane.registry.index(self.repository_names())

    def repository_names(self) -> list[str]:
        return repository_names(self.root, self._plane.archive_store)

    # ------------------------------------------------------------------ poll
    async def poll_forever(self) -> None:
        """Poll mode: look at the repository every ``repository_poll_s`` and apply changes."""
        while True:
            await asyncio.sleep(self._settings.repository_poll_s)
            try:
                await self.poll_once()
            except Exception:
                logger.exception("model repository poll failed")

    async def poll_once(self) -> None:
        loop = asyncio.get_running_loop()
        store = self._plane.archive_store
        sources, problems = await loop.run_in_executor(None, scan, self.root, None, store)
        for problem in set(problems) - self._problems:
            logger.error("model repository: %s (the versions serving stay)", problem)
        self._problems = set(problems)
        registry = self._plane.registry
        async with self._lock:
            for name in sorted(set(sources) | set(registry.versions)):
                source = sources.get(name)
                if source is None:
                    if not self._folder_left(name):
                        continue
                    await self._reconcile(name, None)
                    registry.unloaded.pop(name, None)
                elif self._changed(name, source):
                    try:
                        await self._reconcile(name, source)
                    except LoadFailed as exc:
                        logger.error("%s; the versions serving before stay", exc)

    def _folder_left(self, name: str) -> bool:
        """Whether every folder ``name`` was loaded from is gone (an unreadable config keeps
        the model serving: a half-copied folder must not unload it)."""
        served = self._plane.registry.versions.get(name, {}).values()
        return all(folder_gone(self.root, model.directory) for model in served)

    def _changed(self, name: str, source: ModelSource) -> bool:
        """Whether a served version left the selection, or a selected one is new or changed
        (unless that very version already failed to load)."""
        current = self._plane.registry.versions.get(name, {})
        if set(current) - set(source.versions):
            return True
        return any(
            (v not in current or current[v].fingerprint != s.fingerprint)
            and self._failed.get((name, v)) != s.fingerprint
            for v, s in source.versions.items()
        )
