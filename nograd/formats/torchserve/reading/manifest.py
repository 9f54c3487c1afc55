"""An archive's ``MAR-INF/MANIFEST.json`` and its ``model-config.yaml``, read from its unpacked
folder or straight from the archive."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Final

import yaml

MANIFEST: Final = "MAR-INF/MANIFEST.json"
FILE_FIELDS: Final = ("configFile", "serializedFile", "modelFile")
"""The manifest's fields that name a file of the archive: each must stay inside it."""


class ManifestError(ValueError):
    """A manifest or model-config.yaml that cannot be used; the message names the file."""


def read_manifest(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest (with its ``model`` section's name and handler present) and the
    model-config.yaml it names (empty when it names none), from an unpacked archive."""
    return parse_manifest(lambda name: (folder / name).read_text(encoding="utf-8"))


def parse_manifest(read: Callable[[str], str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``read_manifest`` over ``read``, which gives a file of the archive by its path in it (an
    OSError when it cannot)."""
    try:
        manifest = json.loads(read(MANIFEST))
        model = manifest["model"]
        for key in ("modelName", "handler"):
            if not isinstance(model[key], str) or not model[key]:
                raise ValueError(f"field 'model.{key}' must be a non-empty string")
    except RecursionError as exc:
        raise ManifestError(f"{MANIFEST}: nested too deeply to be a manifest") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{MANIFEST}: cannot read the model's name and handler: {exc}") from exc
    for key in FILE_FIELDS:
        named = model.get(key)
        if named and not _inside(str(named)):
            raise ManifestError(
                f"{MANIFEST}: field 'model.{key}' names {named!r}, outside the archive: "
                "a manifest may name only the archive's own files"
            )
    config_file = model.get("configFile")
    if not config_file:
        return manifest, {}
    try:
        loaded = yaml.safe_load(read(str(config_file)))
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"{config_file}: cannot parse: {exc}") from exc
    if loaded is None:
        return manifest, {}
    if not isinstance(loaded, dict):
        raise ManifestError(f"{config_file}: expected a mapping at the top level")
    return manifest, loaded


def _inside(named: str) -> bool:
    """Whether a path the manifest names stays inside the archive's folder (the archive holds no
    link, so its words alone decide)."""
    path = PurePosixPath(named.replace("\\", "/"))
    return bool(named) and not path.is_absolute() and ".." not in path.parts and "\0" not in named
