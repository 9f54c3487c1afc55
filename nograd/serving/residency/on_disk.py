"""What the repository says of a model that is not resident: its config on disk, read without
loading it, so its metadata and readiness are answered and an ensemble's steps are known before
any of them loads."""

from __future__ import annotations

from pathlib import Path

from nograd.formats.torchserve.reading.archives import ArchiveStore
from nograd.schema.config import ModelConfig, version_order
from nograd.serving.control.repository import find_source
from nograd.serving.errors import InvalidInput, ModelNotFound
from nograd.serving.extensions.ensembles import composing, step_models
from nograd.serving.registry import ModelRegistry, ServedModel


class OnDisk:
    """The repository's models as their files describe them, beside the registry's."""

    def __init__(self, root: Path, store: ArchiveStore, registry: ModelRegistry) -> None:
        self._root = root
        self._store = store
        self._registry = registry

    def steps(self, name: str) -> list[str]:
        """The step models of ``name``, nested ensembles' included: as served, or as its
        config on disk says when it is not resident (none for a plain model)."""
        if name in self._registry.versions:
            return step_models(self._registry, name)
        configs = self.configs(name)
        return composing(configs, {name}, self.configs) if configs else []

    def described(self, name: str, version: str | None) -> ServedModel | None:
        """A model of the repository that is not resident, as its config on disk describes it
        (not ready, nothing loaded): its metadata, config and readiness are answered from it
        without loading it. None when the repository has no such model or version."""
        try:
            source = find_source(self._root, self._store, name)
        except (ModelNotFound, InvalidInput):
            return None
        if version is None and source.versions:
            version = max(source.versions, key=version_order)
        found = source.versions.get(version) if version is not None else None
        return ServedModel.of(found) if found is not None else None

    def configs(self, name: str) -> list[ModelConfig] | None:
        """Every version's config of ``name`` on disk; None when the repository has no such
        model or cannot read it."""
        try:
            source = find_source(self._root, self._store, name)
        except (ModelNotFound, InvalidInput):
            return None
        return [version.config for version in source.versions.values()]
