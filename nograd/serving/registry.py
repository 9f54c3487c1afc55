"""The served models by name: each one's config, state, handler and batcher.

One place answers "which models are there, and is this one ready"; the loader fills it and the
data plane reads it, so models loaded or unloaded while serving change only this.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

from nograd.batching import Batcher
from nograd.runtime.config import ConfigError, ModelConfig, find_config, load_config
from nograd.runtime.handler import ModelHandler, Outputs, TensorPart
from nograd.runtime.planner import ModelPlan
from nograd.serving.errors import ModelNotFound

logger = logging.getLogger(__name__)


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
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    weights_bytes: int = 0
    plan: ModelPlan | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> str:
        return self.config.version

    @property
    def ready(self) -> bool:
        return self.state is State.READY and self.batcher is not None and self.batcher.alive


class ModelRegistry:
    """The repository's models by name, and the configs that could not be read."""

    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}
        self.config_errors: list[str] = []

    def discover(self, root: Path) -> list[ServedModel]:
        """Read every model config under ``root``; a malformed one is logged and recorded."""
        if not root.is_dir():
            raise ConfigError(f"model repository {str(root)!r} is not a folder")
        found = []
        for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            path = find_config(model_dir)
            if path is None:
                continue
            try:
                config = load_config(path)
            except ConfigError as exc:
                self._reject(str(exc))
                continue
            if config.name in self.models:
                self._reject(f"{path}: field 'name': model {config.name!r} is defined twice")
                continue
            model = ServedModel(config, model_dir)
            self.models[config.name] = model
            found.append(model)
        return found

    def _reject(self, message: str) -> None:
        logger.error("model config rejected: %s", message)
        self.config_errors.append(message)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"model {name!r} is not in the repository")
        if version is not None and version != model.version:
            raise ModelNotFound(f"model {name!r} has no version {version!r}")
        return model

    def all_ready(self) -> bool:
        """Every config read and every model serving; a failed one keeps the server not ready."""
        return not self.config_errors and all(m.ready for m in self.models.values())
