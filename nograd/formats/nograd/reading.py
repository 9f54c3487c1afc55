"""A nograd model folder read: its config, and either its files (one version, the config's
``version``) or numbered version folders, each with its files and optionally its own config."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from nograd.formats.source import (
    ModelSource,
    Override,
    VersionSource,
    fingerprint,
    numbered_folders,
    override_text,
    selected,
)
from nograd.schema.config import ConfigError, find_config, load_config


def read_folder(
    model_dir: Path, override: Override | None, versions: Collection[str] | None
) -> ModelSource:
    """The versions of the model in ``model_dir`` its policy selects, or those of ``versions``
    found among its numbered folders; a config that cannot be used raises ``ConfigError`` naming
    the file and the field."""
    path = find_config(model_dir)
    if path is None:
        raise ConfigError(f"{model_dir}: no config.toml or config.yaml")
    top = load_config(path, override=override)
    extra = override_text(override)
    numbered = numbered_folders(model_dir)
    source = ModelSource(top.name, model_dir)
    if not numbered:
        found = fingerprint([model_dir], extra)
        source.versions[top.version] = VersionSource(top, model_dir, found, override)
        return source
    for version in selected(top, numbered, versions):
        version_dir = model_dir / version
        own = find_config(version_dir)
        config = load_config(own or path, override=override, version=version, name=top.name)
        if config.name != top.name:
            raise ConfigError(
                f"{own}: field 'name': {config.name!r} differs from the model's {top.name!r}"
            )
        found = fingerprint([version_dir, path], extra)
        source.versions[version] = VersionSource(config, version_dir, found, override)
    return source
