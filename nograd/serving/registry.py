"""The served models by name and version: each one's config, state, handler and batcher.

One place answers "which models are there, which version answers, and is it ready"; the loader
and model control fill it and the data plane reads it, so models loaded or unloaded while
serving change only this.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import ModuleType

from nograd.batching import Batcher
from nograd.formats.table import Format, reading_format
from nograd.formats.torchserve.reading.archives import ArchiveStore
from nograd.runtime.handler import Outputs, TensorPart
from nograd.runtime.memory.fits import RangedCost
from nograd.runtime.planner import ModelPlan
from nograd.runtime.runners import Handler
from nograd.schema.config import ModelConfig, version_order
from nograd.serving.control.repository import ModelSource, Override, VersionSource, Wanted, scan
from nograd.serving.errors import ControlRefused, ModelNotFound

logger = logging.getLogger(__name__)

LOADING_ON_DEMAND = "loading on its first request"
"""The reason a model not yet resident is listed with while its on-demand load runs."""
NOT_LOADED_YET = "not loaded yet: loads on its first request"


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    UNLOADED = "unloaded"


@dataclass
class ServedModel:
    """One model as served: its config, and once loaded its handler and batcher."""

    config: ModelConfig
    directory: Path
    state: State = State.LOADING
    error: str | None = None
    handler: Handler | None = None
    batcher: Batcher[TensorPart, Outputs] | None = None
    code: ModuleType | None = None
    """The model's code as this load imported it, taken out of ``sys.modules`` when freed."""
    heap_mark: int | None = None
    """The heap's freezes counted when its load began (``nograd.serving.residency.frozen_heap``): a
    version loaded since the last freeze is freed without a walk of the whole heap. None: not
    loaded."""
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds each step of its load took (``build``, ``engines``, ``profile``), for the
    start-up summary (``nograd.serving.control.ready_summary``)."""
    weights_bytes: int = 0
    resident_bytes: int = 0
    """Under on-demand control on CPU, what this version holds outside its batches as its load
    measured it (weights and engine sessions); the batches share what these leave of the
    limit. 0: not measured (its weights count)."""
    plan: ModelPlan | None = None
    profile: RangedCost | None = None
    """The measured activation cost, kept so memory can be planned again when models change."""
    loaded_as: str = ""
    """What its torch module was loaded as (``nograd.runtime.engines.remembered.model_key``),
    taken before its engines were installed: its memory profile is remembered under it. Empty:
    not remembered."""
    fingerprint: str = ""
    """The files it was loaded from (``nograd.serving.control.repository``): a change means a
    reload."""
    active: int = 0
    """Requests holding this version, from lookup to answer: an unloaded version is freed only
    once they are done."""
    drained: asyncio.Event | None = None
    """Set when ``active`` drops to zero, for an unload waiting on it."""
    override: Override | None = None
    """The load call's config override it was loaded with (recorded for the sibling workers)."""
    waiting_for: Callable[[], str | None] | None = None
    """An ensemble's readiness (``nograd.serving.extensions.ensembles``): why it is not ready (a
    step model that is not), or None. An ensemble has no batcher of its own."""

    @classmethod
    def of(cls, source: VersionSource) -> ServedModel:
        """A version found on disk, to load."""
        fingerprint, override = source.fingerprint, source.override
        return cls(source.config, source.directory, fingerprint=fingerprint, override=override)

    @cached_property
    def format(self) -> Format:
        """The format that read it (``nograd.formats``): its refusals, warm-up and label apply.
        Found once: the requests that ask it find it here."""
        return reading_format(self.config)

    def hold(self) -> None:
        """A request holds this version from its lookup until ``let_go``."""
        self.active += 1

    def let_go(self) -> None:
        """A request holding this version is done; the last one wakes an unload waiting."""
        self.active -= 1
        if self.active == 0 and self.drained is not None:
            self.drained.set()

    async def all_let_go(self, timeout_s: float) -> None:
        """Return once no request holds this version, or after ``timeout_s``."""
        if self.active:
            self.drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained.wait(), timeout_s)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> str:
        return self.config.version

    @property
    def ready(self) -> bool:
        if self.waiting_for is not None:
            return self.state is State.READY and self.waiting_for() is None
        return self.state is State.READY and self.batcher is not None and self.batcher.alive

    def why_not_ready(self) -> str:
        """What keeps this version from serving, for the 503 that says so."""
        if self.state is State.READY and self.waiting_for is not None:
            return self.waiting_for() or "ready"
        if self.state is State.FAILED:
            return f"failed to load: {self.error}"
        if self.state is State.LOADING:
            return "still loading"
        return "its batch loop is not running"


class ModelRegistry:
    """The served models: every loaded version by name, the version each name answers with, the
    models the repository holds but that are not loaded, and the configs that could not be read.
    """

    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}
        """Per name, the version a request without a version goes to: the newest ready one (the
        newest one while none is ready). Changed in place, so holders of the dict see changes."""
        self.versions: dict[str, dict[str, ServedModel]] = {}
        """Per name, every version loaded or loading."""
        self.unloaded: dict[str, str] = {}
        """Models of the repository that are not loaded, with the reason."""
        self.config_errors: list[str] = []

    def discover(
        self,
        root: Path,
        load: Callable[[str], bool] | None = None,
        wanted: Wanted | None = None,
        archives: ArchiveStore | None = None,
    ) -> list[ServedModel]:
        """Read every model config under ``root`` and register the versions to serve (those for
        which ``load(name)`` holds, every model without it; of a model in ``wanted``, the
        versions and overrides it names). A malformed config is logged and recorded."""
        sources, problems = scan(root, wanted, archives)
        for problem in problems:
            self._reject(problem)
        if load is not None:
            load = with_step_models(sources, load).__contains__
        found = []
        for name, source in sources.items():
            if load is not None and not load(name):
                self.unloaded[name] = "not loaded at start-up"
                continue
            if not source.versions:
                self.unloaded[name] = "none of the versions to load is in the repository"
                continue
            for version in source.versions.values():
                model = ServedModel.of(version)
                self.add(model)
                found.append(model)
        return found

    def _reject(self, message: str) -> None:
        logger.error("model config rejected: %s", message)
        self.config_errors.append(message)

    def add(self, model: ServedModel) -> None:
        """Register a version (loading); it takes requests once ready and the newest."""
        self.versions.setdefault(model.name, {})[model.version] = model
        self.unloaded.pop(model.name, None)
        self.refresh(model.name)

    def remove(self, model: ServedModel, reason: str | None = None) -> None:
        """Take a version out: requests that already hold it finish, new ones go elsewhere."""
        versions = self.versions.get(model.name, {})
        if versions.get(model.version) is model:
            del versions[model.version]
        if not versions:
            self.versions.pop(model.name, None)
            if reason is not None:
                self.unloaded[model.name] = reason
        self.refresh(model.name)

    def refresh(self, name: str) -> None:
        """Point ``name`` at its newest ready version (the newest one while none is ready)."""
        versions = self.versions.get(name)
        if not versions:
            self.models.pop(name, None)
            return
        ordered = sorted(versions.values(), key=lambda m: version_order(m.version))
        ready = [m for m in ordered if m.ready]
        self.models[name] = (ready or ordered)[-1]

    def served(self) -> list[ServedModel]:
        """Every version loaded or loading."""
        return [m for versions in self.versions.values() for m in versions.values()]

    def index(self, in_repository: Iterable[str]) -> list[ServedModel | tuple[str, str]]:
        """Every version loaded or loading, and (name, reason) for each model of the repository
        (``in_repository``) that is not loaded."""
        rows: list[ServedModel | tuple[str, str]] = list(self.served())
        for name in sorted(set(in_repository) | set(self.unloaded)):
            if name not in self.versions:
                rows.append((name, self.unloaded.get(name, "not loaded")))
        return rows

    def overrides(self) -> dict[str, dict[str, Override | None]]:
        """Every version registered (loading, ready or failed), with its load call's override:
        what the workers record as served."""
        return {
            name: {version: model.override for version, model in versions.items()}
            for name, versions in self.versions.items()
        }

    def check_cap(self, name: str, versions: int, cap: int | None) -> None:
        """Refuse a load of ``versions`` of ``name`` that would leave more versions loaded than
        ``cap`` (``max_loaded_models``), before it reads a weight."""
        total = self.loaded_besides(name) + versions
        if cap is not None and total > cap:
            raise ControlRefused(
                f"loading model {name!r} ({versions} version(s)) would make {total} model "
                f"versions loaded, over the cap of {cap} (NOGRAD_MAX_LOADED_MODELS); unload a "
                "model first"
            )

    def loaded_besides(self, name: str) -> int:
        """Versions loaded or loading of every model but ``name`` (failed ones hold nothing)."""
        return sum(
            1
            for other, versions in self.versions.items()
            if other != name
            for model in versions.values()
            if model.state is not State.FAILED
        )

    def version_names(self, name: str) -> list[str]:
        return sorted(self.versions.get(name, {}), key=version_order)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            # Triton's words first (its clients match on them), then why.
            if name in self.unloaded:
                raise ModelNotFound(
                    f"Request for unknown model: '{name}' has no available versions "
                    f"({self.unloaded[name]})"
                )
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        if version is None:
            return model
        found = self.versions.get(name, {}).get(version)
        if found is None:
            raise ModelNotFound(
                f"Request for unknown model: '{name}' version {version} is not found"
            )
        return found

    def all_ready(self) -> bool:
        """Every config read and every version serving; a failed one keeps the server not ready."""
        return not self.config_errors and all(m.ready for m in self.served())


def with_step_models(sources: dict[str, ModelSource], load: Callable[[str], bool]) -> set[str]:
    """The models ``load`` selects and the step models of the ensembles among them, nested
    ones' included: Triton loads an ensemble's step models with it."""
    selected = {name for name in sources if load(name)}
    waiting = list(selected)
    while waiting:
        source = sources.get(waiting.pop())
        if source is None:
            continue
        for version in source.versions.values():
            for step in version.config.steps:
                if step.model not in selected:
                    selected.add(step.model)
                    waiting.append(step.model)
    return selected
