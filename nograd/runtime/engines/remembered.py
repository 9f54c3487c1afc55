"""An engine choice remembered in the engine cache, so a model loaded again (a restart, a reload,
an on-demand load after an eviction) opens the engines it chose before instead of exporting,
building, checking and timing them again: loads are what on-demand serving makes users wait for.

The record is keyed by everything the choice was made from: the engine and library versions, the
device type, the model's config, code and weights (hashed by value), and the batch limit it was
timed up to. Any change measures again; a record whose artifacts are gone is measured again too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch

from nograd.runtime.engines.artifacts import (
    cache_file,
    file_sha256,
    hash_tensor,
    onnxruntime_version,
    write_text_atomically,
)
from nograd.runtime.handler import ModelHandler
from nograd.runtime.speed.accuracy import AccuracyReport, OutputDelta

logger = logging.getLogger(__name__)

FORMAT: Final = 1
"""The record's layout; a record of another layout is measured again."""


@dataclasses.dataclass(frozen=True)
class Remembered:
    """A choice as measured at an earlier load: the table, and each accepted engine's artifact."""

    table: dict[str, Any]
    artifacts: dict[str, Path]


def choice_key(
    handler: ModelHandler, limit: int, code: Sequence[Path], digest: str | None = None
) -> str:
    """What the choice depends on, known before any export: the model's ``digest``
    (``model_digest``, hashed now when not given) and ONNX Runtime's version."""
    return keyed(digest or model_digest(handler, limit, code), (onnxruntime_version(),))


def model_key(
    handler: ModelHandler, limit: int, code: Sequence[Path], libraries: Sequence[str]
) -> str:
    """The model as loaded (``model_digest``) and ``libraries``' versions (what else ran it)."""
    return keyed(model_digest(handler, limit, code), libraries)


def keyed(digest: str, libraries: Sequence[str]) -> str:
    """A record's key: the model's ``digest`` and the versions of ``libraries``. A load hashes
    its weights once and derives each record's key from that."""
    key = hashlib.sha256(digest.encode() + b"\0")
    for library in libraries:
        key.update(library.encode() + b"\0")
    return key.hexdigest()[:24]


def model_digest(
    handler: ModelHandler, limit: int, code: Sequence[Path], cache_dir: Path | None = None
) -> str:
    """The model as loaded: torch's version, the device type, its config, the batch limit, its
    code and its weights by value (an artifact model, which has no eager module, has its weights
    in its artifact, one of ``code``; its digest recorded in ``cache_dir``, ``file_sha256``)."""
    digest = hashlib.sha256()
    config = handler.config.model_dump(mode="json")
    for part in (
        str(FORMAT),
        torch.__version__,
        handler.device.type,
        json.dumps(config, sort_keys=True, default=str),
        str(limit),
    ):
        digest.update(part.encode() + b"\0")
    for path in code:
        if path.is_file():
            digest.update(file_sha256(path, cache_dir))
    state = handler.module.state_dict() if handler.module is not None else {}
    for name in sorted(state):
        tensor = state[name]
        if isinstance(tensor, torch.Tensor):
            hash_tensor(digest, name, tensor)
    return digest.hexdigest()


def _record_path(cache_dir: Path, label: str, key: str) -> Path:
    return cache_file(cache_dir, f"{label}-choice-{key}.json")


def recall(cache_dir: Path, label: str, key: str) -> Remembered | None:
    """The remembered choice, or None when there is none or an artifact it names is gone."""
    try:
        path = _record_path(cache_dir, label, key)
        document = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return None
    artifacts = {name: Path(file) for name, file in document.get("artifacts", {}).items()}
    if not all(path.exists() for path in artifacts.values()):
        return None
    return Remembered(document["table"], artifacts)


def remember(
    cache_dir: Path, label: str, key: str, table: dict[str, Any], artifacts: dict[str, Path]
) -> None:
    """Write the record atomically; a cache that cannot be written only costs the next load."""
    document = {
        "format": FORMAT,
        "table": table,
        "artifacts": {name: str(file) for name, file in artifacts.items()},
    }
    try:
        # A temporary file of its own: two processes remembering the same choice at once each
        # rename a whole record into place.
        write_text_atomically(_record_path(cache_dir, label, key), json.dumps(document))
    except OSError as exc:
        logger.warning("engine cache: could not remember the engine choice (%s)", exc)


def report_from(document: dict[str, Any] | None) -> AccuracyReport | None:
    """An accuracy report as ``dataclasses.asdict`` wrote it."""
    if document is None:
        return None
    outputs = tuple(OutputDelta(**delta) for delta in document["outputs"])
    return AccuracyReport(outputs, document["batches"])
