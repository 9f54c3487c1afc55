"""TorchServe model archives (``.mar``) in the repository, read into nograd's own model config.

An archive is a zip that ``torch-model-archiver`` wrote: ``MAR-INF/MANIFEST.json`` names the
model, its version and its handler; ``model-config.yaml`` (the manifest's ``configFile``) sets
batching. A scan, the index and the describe call read those two files straight from the
archive; an archive is unpacked only when a model loads from it, once per content, into a folder
of the cache named by its SHA-256, and only after every member's path is checked to stay inside
that folder. Each process that loads from that folder holds it (a file named by its pid); the
folder is removed once no live process holds it (at unload, at stop, and at start for what a
process that died left). The rest of the server sees a model folder and a ``ModelConfig`` whose
format is ``torchserve``; this module is the one place that knows the archive's layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any, Final

from nograd.formats.torchserve.reading.manifest import (
    MANIFEST,
    ManifestError,
    parse_manifest,
    read_manifest,
)
from nograd.schema.config import TORCHSERVE_FORMAT, ConfigError, ModelConfig, TensorSpec

logger = logging.getLogger(__name__)

SUFFIX: Final = ".mar"
CHUNK_BYTES: Final = 1 << 20
DONE_MARK: Final = ".unpacked"
HOLDERS: Final = ".holders"
"""Beside an unpacked folder, ``<folder>.holders/<pid>``: the processes that load from it."""
LOCK_FILE: Final = ".lock"
"""The cache's lock: unpacking, holding and removing a folder are one step against the others."""
MAX_METADATA_BYTES: Final = 1 << 20
"""The most the manifest or model-config.yaml may take, read from the archive unpacked."""
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
    max_bytes: int = 4 * 1024**3
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
_SOURCES: dict[Path, tuple[Path, ArchiveStore]] = {}
"""Folder -> the archive it unpacks from, and its store: what a load unpacks."""
_HELD: Counter[Path] = Counter()
"""Folder -> how many loaded versions of this process hold it."""


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
    folder = store.cache / digest[:32]
    _ORIGINS[folder] = path.name
    _SOURCES[folder] = (path, store)
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
    """The manifest and model-config.yaml of an archive, from its folder once unpacked, else
    from the archive itself (the folder is named by its content, so what is read once stays
    true)."""
    source = _SOURCES.get(folder)
    try:
        if (folder / DONE_MARK).is_file() or source is None:
            manifest, yaml_config = read_manifest(folder)
        else:
            manifest, yaml_config = _read_packed(*source)
    except ManifestError as exc:
        where = folder if source is None else source[0]
        raise ConfigError(f"{where}: {exc}") from exc
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


def _read_packed(path: Path, store: ArchiveStore) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and model-config.yaml read from the archive, its members checked first as
    for unpacking, each of the two within ``MAX_METADATA_BYTES``."""
    try:
        with zipfile.ZipFile(path) as archive:
            _check_members(path, archive.infolist(), store)

            def read(name: str) -> str:
                try:
                    member = archive.getinfo(name)
                except KeyError:
                    raise FileNotFoundError(f"no {name} in the archive") from None
                if member.file_size > MAX_METADATA_BYTES:
                    raise ManifestError(
                        f"{name}: {member.file_size} bytes, over the {MAX_METADATA_BYTES} bytes "
                        "a manifest or model-config.yaml may take"
                    )
                with archive.open(member) as opened:
                    return opened.read(MAX_METADATA_BYTES + 1).decode("utf-8")

            return parse_manifest(read)
    except (OSError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the archive's {MANIFEST}: {exc}") from exc


def declared_bytes(folder: Path) -> int | None:
    """What the archive ``folder`` unpacks from takes unpacked, by its members' declared sizes
    (bounded by ``max_bytes`` when it unpacks); None for a folder that is no archive's."""
    source = _SOURCES.get(folder)
    if source is None:
        return None
    try:
        with zipfile.ZipFile(source[0]) as archive:
            return sum(member.file_size for member in archive.infolist())
    except (OSError, zipfile.BadZipFile):
        return None


def hold(folder: Path) -> Path:
    """The archive of ``folder`` unpacked there (now, if no process did yet), and held by this
    process until as many ``release`` calls: a model loads from it."""
    path, store = _SOURCES[folder]
    with _locked(store.cache):
        mark = _holders(folder) / str(os.getpid())
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
        try:
            unpack(path, folder, store)
        except BaseException:
            if not _HELD[folder]:
                mark.unlink(missing_ok=True)
                _remove_unheld(folder)
            raise
    _HELD[folder] += 1
    return folder


def release(folder: Path) -> None:
    """One loaded version of this process no longer uses ``folder``: once none does, this
    process's hold goes, and the folder with it unless another live process holds it."""
    if _HELD[folder] <= 0:
        return
    _HELD[folder] -= 1
    if _HELD[folder]:
        return
    del _HELD[folder]
    source = _SOURCES.get(folder)
    cache = folder.parent if source is None else source[1].cache
    with _locked(cache):
        (_holders(folder) / str(os.getpid())).unlink(missing_ok=True)
        _remove_unheld(folder)


def release_all() -> None:
    """At stop: every hold of this process goes."""
    for folder in list(_HELD):
        _HELD[folder] = 1
        release(folder)


def sweep(cache: Path) -> None:
    """Remove every unpacked folder of ``cache`` that no live process holds (left by a process
    that died, or by a version of nograd that kept them): at start."""
    if not cache.is_dir():
        return
    with _locked(cache):
        for entry in cache.iterdir():
            if entry.is_dir() and not entry.name.endswith(HOLDERS) and entry.name != LOCK_FILE:
                _remove_unheld(entry)


def _holders(folder: Path) -> Path:
    return folder.with_name(folder.name + HOLDERS)


def _remove_unheld(folder: Path) -> None:
    """Remove ``folder`` (an unpacked archive, or an unpacking one left behind) unless a live
    process holds it; the cache's lock is held."""
    holders = _holders(folder)
    if holders.is_dir():
        for holder in list(holders.iterdir()):
            if _alive(holder.name):
                return
            holder.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(holders, ignore_errors=True)


def _alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's live process
    return True


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / LOCK_FILE).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
