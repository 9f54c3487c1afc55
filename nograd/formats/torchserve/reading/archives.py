"""TorchServe model archives (``.mar``) in the repository, read into nograd's own model config.

An archive is a zip that ``torch-model-archiver`` wrote: ``MAR-INF/MANIFEST.json`` names the
model, its version and its handler; ``model-config.yaml`` (the manifest's ``configFile``) sets
batching. Each archive is unpacked once per content, into a folder of the cache named by its
SHA-256, and only after every member's path is checked to stay inside that folder. The rest of the
server sees a model folder and a ``ModelConfig`` whose format is ``torchserve``; this module is the
one place that knows the archive's layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any, Final

from nograd.formats.torchserve.reading.manifest import ManifestError, read_manifest
from nograd.schema.config import TORCHSERVE_FORMAT, ConfigError, ModelConfig, TensorSpec

logger = logging.getLogger(__name__)

SUFFIX: Final = ".mar"
CHUNK_BYTES: Final = 1 << 20
DONE_MARK: Final = ".unpacked"
INPUT: Final = TensorSpec(name="body", datatype="BYTES", shape=())
OUTPUT: Final = TensorSpec(name="answer", datatype="BYTES", shape=())
DEFAULT_BATCH_SIZE: Final = 1
DEFAULT_BATCH_DELAY_MS: Final = 100.0
"""TorchServe's defaults for ``batchSize`` and ``maxBatchDelay``."""
APPLIED_KEYS: Final = frozenset(
    {"batchSize", "maxBatchDelay", "minWorkers", "maxWorkers", "responseTimeout", "handler"}
)
"""model-config.yaml keys nograd honours (workers and the response timeout are reported by the
describe call; the handler section reaches the handler through its context)."""
IGNORED_KEYS: Final = frozenset(
    {
        "startupTimeout",
        "deviceType",
        "deviceIds",
        "parallelType",
        "parallelLevel",
        "torchrun",
        "pt2",
        "continuousBatching",
        "useJobTicket",
        "useVenv",
        "stateful",
        "sequenceMaxIdleMSec",
        "sequenceTimeoutMSec",
        "maxSequenceJobQueueSize",
        "maxNumSequence",
        "clientTimeoutInMills",
        "maxRetryTimeoutInSec",
        "jobQueueSize",
        "micro_batching",
    }
)
"""TorchServe keys nograd reads but does not apply: named in a warning at load."""


@dataclass(frozen=True)
class ArchiveStore:
    """Where archives are unpacked and how much one may unpack to (``NOGRAD_MAX_ARCHIVE_BYTES``,
    ``NOGRAD_MAX_ARCHIVE_MEMBERS``): a zip bomb is refused, not written until the disk fills."""

    cache: Path
    max_bytes: int = 16 * 1024**3
    max_members: int = 10_000


@dataclass(frozen=True)
class Archive:
    """What the describe and list calls report of an unpacked archive."""

    name: str
    version: str
    """TorchServe's own version string (``1.0``): nograd serves the archive as version 1."""
    handler: str
    archive_file: str
    yaml_config: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)

    def setting(self, key: str, default: int) -> int:
        value = self.yaml_config.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else default


_ORIGINS: dict[Path, str] = {}
"""Unpacked folder -> the archive's file name, for the list call's ``modelUrl``."""
_DIGESTS: dict[tuple[str, int, int], str] = {}
"""(path, size, mtime) -> SHA-256: an unchanged archive is not read again at every scan."""


def origin(folder: Path) -> str | None:
    """The file name of the archive ``folder`` was unpacked from; None for any other folder."""
    return _ORIGINS.get(folder)


def archives(root: Path) -> list[Path]:
    """The ``.mar`` files directly in the repository."""
    return sorted(p for p in root.glob(f"*{SUFFIX}") if p.is_file())


def read_archive(
    path: Path, store: ArchiveStore, override: Mapping[str, object] | None = None
) -> tuple[ModelConfig, Path, str]:
    """The archive's model config (with a load call's ``override`` of batching fields), its
    unpacked folder and its fingerprint (its digest, and the override); an archive that cannot
    be used raises ``ConfigError`` naming the file and what is wrong."""
    digest = _digest(path)
    folder = unpack(path, store.cache / digest[:32], store)
    _ORIGINS[folder] = path.name
    facts = describe(folder)
    yaml_config = facts.yaml_config
    unknown = sorted(set(yaml_config) - APPLIED_KEYS - IGNORED_KEYS)
    if unknown:
        logger.warning("%s: model-config.yaml: unknown key(s) %s, ignored", path, unknown)
    ignored = sorted(set(yaml_config) & IGNORED_KEYS)
    if ignored:
        logger.warning("%s: model-config.yaml: key(s) %s are not applied by nograd", path, ignored)
    handler_file = facts.handler.split(":", 1)[0]
    raw: dict[str, Any] = {
        "name": facts.name,
        "version": "1",
        "format": TORCHSERVE_FORMAT,
        "weights": None,
        "inputs": [INPUT],
        "outputs": [OUTPUT],
        "max_batch_size": yaml_config.get("batchSize", DEFAULT_BATCH_SIZE),
        "max_queue_delay_ms": yaml_config.get("maxBatchDelay", DEFAULT_BATCH_DELAY_MS),
        **(override or {}),
    }
    if handler_file.endswith(".py"):
        raw["module"] = handler_file
    try:
        config = ModelConfig.model_validate(raw)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return config, folder, _fingerprint(digest, override)


def _fingerprint(digest: str, override: Mapping[str, object] | None) -> str:
    """The archive's content, and the override it is served with."""
    if not override:
        return digest[:16]
    extra = json.dumps(override, sort_keys=True, default=str)
    return hashlib.sha256(f"{digest}\0{extra}".encode()).hexdigest()[:16]


def unpack(path: Path, folder: Path, store: ArchiveStore) -> Path:
    """``path`` unpacked into ``folder`` once; every member checked first (no absolute path, no
    ``..``, no link; the count and declared sizes within the store's bounds), and the bytes
    counted while unpacking, so nothing is ever written outside it or past the bound."""
    if (folder / DONE_MARK).is_file():
        return folder
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            _check_members(path, members, store)
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=folder.parent))
            try:
                _extract(path, archive, members, staging, store.max_bytes)
                (staging / DONE_MARK).touch()
                try:
                    os.replace(staging, folder)
                except OSError:
                    if not (folder / DONE_MARK).is_file():  # not another process's, finished
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except (OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise ConfigError(f"{path}: cannot unpack the archive: {exc}") from exc
    return folder


def _check_members(path: Path, members: list[zipfile.ZipInfo], store: ArchiveStore) -> None:
    if len(members) > store.max_members:
        raise ConfigError(
            f"{path}: holds {len(members)} members, over the limit of {store.max_members} "
            "(NOGRAD_MAX_ARCHIVE_MEMBERS); refused unread"
        )
    for member in members:
        _check_member(path, member)
    declared = sum(member.file_size for member in members)
    if declared > store.max_bytes:
        raise _too_large(path, store.max_bytes, f"declares {declared} bytes unpacked")


def _extract(
    path: Path,
    archive: zipfile.ZipFile,
    members: list[zipfile.ZipInfo],
    staging: Path,
    max_bytes: int,
) -> None:
    """Write each member under ``staging``, counting the bytes actually inflated: an archive
    whose headers understate its sizes is stopped at the bound, not at the disk's end."""
    written = 0
    for member in members:
        parts = [p for p in PurePosixPath(member.filename.replace("\\", "/")).parts if p != "."]
        if not parts:
            continue
        target = staging.joinpath(*parts)
        if member.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with archive.open(member) as source, target.open("wb") as sink:
            while chunk := source.read(CHUNK_BYTES):
                written += len(chunk)
                if written > max_bytes:
                    raise _too_large(path, max_bytes, f"inflates past {written} bytes")
                sink.write(chunk)


def _check_member(path: Path, member: zipfile.ZipInfo) -> None:
    name = member.filename
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if name.startswith(("/", "\\")) or (parts and ":" in parts[0]) or ".." in parts:
        raise ConfigError(f"{path}: member {name!r} would be written outside the archive's folder")
    if stat.S_ISLNK(member.external_attr >> 16):
        raise ConfigError(f"{path}: member {name!r} is a symbolic link; archives may not hold any")


def _too_large(path: Path, limit: int, what: str) -> ConfigError:
    return ConfigError(
        f"{path}: {what}, over the limit of {limit} bytes (NOGRAD_MAX_ARCHIVE_BYTES); refused"
    )


@lru_cache(maxsize=256)
def describe(folder: Path) -> Archive:
    """The manifest and model-config.yaml of an unpacked archive (the folder is named by its
    content, so what is read once stays true)."""
    try:
        manifest, yaml_config = read_manifest(folder)
    except ManifestError as exc:
        raise ConfigError(f"{folder}: {exc}") from exc
    model = manifest["model"]
    name = str(model["modelName"])
    return Archive(
        name=name,
        version=str(model.get("modelVersion", "1.0")),
        handler=str(model["handler"]),
        archive_file=_ORIGINS.get(folder, f"{name}{SUFFIX}"),
        yaml_config=yaml_config,
        manifest=manifest,
    )


def _digest(path: Path) -> str:
    info = path.stat()
    key = (str(path), info.st_size, info.st_mtime_ns)
    known = _DIGESTS.get(key)
    if known is None:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        known = _DIGESTS[key] = digest.hexdigest()
    return known
