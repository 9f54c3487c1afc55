"""A model as a format finds it on disk: the versions its folder serves, each with its config and
a fingerprint (file names, sizes and modification times, never contents), so the repository
compares what is on disk with what serves without reading weights."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from nograd.schema.config import ConfigError, ModelConfig, is_version, version_order

Override = Mapping[str, object]
"""Config fields a load call sets over the file's (Triton's ``config`` parameter)."""


@dataclass(frozen=True)
class VersionSource:
    """One version as found on disk."""

    config: ModelConfig
    directory: Path
    """Where the version's code and weights are looked up first (then the model's folder)."""
    fingerprint: str
    override: Override | None = None
    """The load call's config override it was read with."""


@dataclass(frozen=True)
class ModelSource:
    """One model folder: the versions its policy selects, oldest first."""

    name: str
    directory: Path
    versions: dict[str, VersionSource] = field(default_factory=dict)


def numbered_folders(model_dir: Path) -> list[str]:
    """The names of the model's numbered version folders, in name order."""
    return sorted(d.name for d in model_dir.iterdir() if d.is_dir() and is_version(d.name))


def selected(top: ModelConfig, numbered: list[str], versions: Collection[str] | None) -> list[str]:
    """The numbered versions to read: those the policy selects, or those ``versions`` names."""
    if versions is None:
        return list(top.version_policy.select(numbered))
    return sorted((v for v in numbered if v in versions), key=version_order)


def override_text(override: Override | None) -> str:
    return json.dumps(override, sort_keys=True, default=str) if override else ""


def fingerprint(roots: list[Path], extra: str) -> str:
    """Names, sizes and modification times of every file under ``roots``: a change to any file
    (code, weights, config) changes it."""
    digest = hashlib.sha256(extra.encode())
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in files:
            if "__pycache__" in path.parts or not path.is_file():
                continue
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def shared_config_source(
    top: ModelConfig,
    model_dir: Path,
    override: Override | None,
    versions: Collection[str] | None,
) -> ModelSource:
    """A folder whose numbered version folders all serve one config, ``top`` (read from the
    folder's own files, as Triton's ``config.pbtxt``): the versions selected, each fingerprinted
    with its folder and the model folder's own files; ``override`` set over ``top``."""
    if override:
        try:
            top = ModelConfig.model_validate({**top.model_dump(), **override})
        except ValidationError as exc:
            raise ConfigError(f"{model_dir}: config override: {exc}") from exc
    numbered = numbered_folders(model_dir)
    if not numbered:
        raise ConfigError(f"{model_dir}: no numbered version folder (1/, 2/, ...) holds the model")
    source = ModelSource(top.name, model_dir)
    shared = sorted(p for p in model_dir.iterdir() if p.is_file())
    extra = override_text(override)
    for version in selected(top, numbered, versions):
        version_dir = model_dir / version
        config = top.model_copy(update={"version": version})
        found = fingerprint([version_dir, *shared], extra)
        source.versions[version] = VersionSource(config, version_dir, found, override)
    return source
