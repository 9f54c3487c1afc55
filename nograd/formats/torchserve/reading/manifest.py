"""An unpacked archive's ``MAR-INF/MANIFEST.json`` and its ``model-config.yaml``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import yaml

MANIFEST: Final = "MAR-INF/MANIFEST.json"


class ManifestError(ValueError):
    """A manifest or model-config.yaml that cannot be used; the message names the file."""


def read_manifest(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest (with its ``model`` section's name and handler present) and the
    model-config.yaml it names (empty when it names none)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        model = manifest["model"]
        for key in ("modelName", "handler"):
            if not isinstance(model[key], str) or not model[key]:
                raise ValueError(f"field 'model.{key}' must be a non-empty string")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{MANIFEST}: cannot read the model's name and handler: {exc}") from exc
    config_file = model.get("configFile")
    if not config_file:
        return manifest, {}
    try:
        loaded = yaml.safe_load((folder / str(config_file)).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"{config_file}: cannot parse: {exc}") from exc
    if loaded is None:
        return manifest, {}
    if not isinstance(loaded, dict):
        raise ManifestError(f"{config_file}: expected a mapping at the top level")
    return manifest, loaded
