"""Model files sent with a load call (Triton's ``file:<path>`` load parameters, with ``config``):
a Triton model folder written outside the repository, which the load (and every sibling worker)
reads in place of the repository's folder of that name until a load without files or an unload.

An uploaded model is code the caller chose (a Python model's ``model.py``), so uploads are off
unless ``NOGRAD_MODEL_UPLOADS`` is set, and only under ``NOGRAD_MODEL_CONTROL=explicit``. A folder
that cannot be written as sent answers as Triton does (``failed to poll from model repository``).
An upload is written whole into a staging folder first, put in place for its load, and taken
away again when the load fails (the upload it replaced put back), so only the uploads that serve
stay on disk, within ``NOGRAD_MAX_UPLOADS`` and ``NOGRAD_MAX_UPLOAD_BYTES``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from nograd.formats.triton.reading.config import CONFIG_FILE
from nograd.formats.triton.reading.config_json import ConfigTooDeep, config_text
from nograd.serving.control.repository import ModelSource, Override, VersionSource, Wanted
from nograd.serving.errors import ControlRefused, InvalidInput, ModelNotFound, PollFailed
from nograd.serving.registry import ModelRegistry
from nograd.settings import Settings

logger = logging.getLogger(__name__)

Finder = Callable[[str, Override | None, dict[str, Override | None] | None], ModelSource]
"""How model control reads a model (``ModelControl._find``): name, override, wanted versions."""

FILE_PREFIX: Final = "file:"
NAME_MAX: Final = 255
"""The longest file or folder name the file system takes (Linux's NAME_MAX, in bytes)."""
SETTING: Final = "NOGRAD_MODEL_UPLOADS"
UPLOADS_FOLDER: Final = "uploads"
"""The uploaded models' folder, in the folder the workers share."""
STAGING_FOLDER: Final = ".staging"
"""Where an upload is written before its load, and the upload it replaces waits during it (a
name no model can have, so the repository's readers never take it for a model)."""
UPLOAD_ROOTS: set[Path] = set()
"""The upload folders of this process: a model read from one is bounded by it."""


class UploadsFull(ControlRefused):
    """A load call's files would keep more uploads, or more bytes of them, than the server
    keeps (``NOGRAD_MAX_UPLOADS``, ``NOGRAD_MAX_UPLOAD_BYTES``)."""


@dataclass(frozen=True)
class Upload:
    """A load call's model: its Triton config as JSON text (None: not sent) and its files by
    path within the model folder (``1/model.py``)."""

    config: str | None
    files: dict[str, bytes]

    @property
    def size(self) -> int:
        return sum(len(content) for content in self.files.values()) + len(self.config or "")


@dataclass(frozen=True)
class UploadBounds:
    """What the uploads kept together may hold: how many models, and how many bytes."""

    max_uploads: int
    max_bytes: int


class Placement:
    """What a load call changed of its model's upload, kept once the load serves or undone
    when it fails: the upload it replaced waits aside until then."""

    def __init__(self, current: Path, aside: Path | None, placed: bool) -> None:
        self._current = current
        self._aside = aside
        self._placed = placed

    def keep(self) -> None:
        if self._aside is not None:
            shutil.rmtree(self._aside, ignore_errors=True)

    def undo(self) -> None:
        if self._placed:
            shutil.rmtree(self._current, ignore_errors=True)
        if self._aside is not None:
            try:
                os.replace(self._aside, self._current)
            except OSError as exc:
                logger.error("the upload of %s could not be put back: %s", self._current, exc)


def file_content(key: str, value: object) -> bytes:
    """A ``file:`` parameter's bytes: raw over gRPC (``bytes_param``), base64 text over HTTP."""
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise InvalidInput(f"parameter {key!r}: a file's content must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise InvalidInput(f"parameter {key!r}: a file's content is not base64: {exc}") from exc


class Uploads:
    """The folder of uploaded models (one sub-folder per model name), shared by the workers."""

    def __init__(
        self,
        folder: Path | None,
        enabled: bool,
        mode: str,
        bounds: UploadBounds | None = None,
        server_folders: Sequence[Path] = (),
    ) -> None:
        """``folder``: shared with the sibling workers (None: a private one, made when needed);
        ``server_folders``: the server's others (``server_paths``)."""
        self._folder = folder
        self._owned = folder is None
        if folder is not None:
            UPLOAD_ROOTS.add(folder)
        self._enabled = enabled
        self._mode = mode
        self._bounds = bounds
        self._server_folders = list(server_folders)

    @classmethod
    def shared(cls, shared_dir: Path | None, settings: Settings) -> Uploads:
        """The uploads of a worker sharing ``shared_dir`` with its siblings (None: alone)."""
        folder = None if shared_dir is None else shared_dir / UPLOADS_FOLDER
        bounds = UploadBounds(settings.max_uploads, settings.max_upload_bytes)
        known = [settings.model_repository, settings.engine_cache_dir]
        return cls(folder, settings.model_uploads, settings.model_control, bounds, known)

    def server_paths(self) -> list[Path]:
        """The server's folders a load's failure may name, left out of its client's answer:
        the repository, the caches (engines, unpacked archives), the uploads."""
        folders = self._server_folders
        return folders if self._folder is None else [*folders, self._folder]

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="nograd-uploads-"))
            UPLOAD_ROOTS.add(self._folder)
        return self._folder

    def holds(self, name: str) -> bool:
        return self._folder is not None and (self._folder / name / CONFIG_FILE).is_file()

    def stage(self, name: str, upload: Upload) -> Path:
        """Write ``upload`` as model ``name``'s folder, in the staging folder: nothing serves it
        until ``place``. Checked first (nothing is written on a refusal): uploads on, a config
        sent, every path inside the model's folder and each of its names within ``NAME_MAX``,
        the uploads kept within their bounds."""
        if not self._enabled:
            raise InvalidInput(
                f"model files cannot be uploaded with a load call ({SETTING} is off): put them "
                f"in the model repository and load the model by name, or set {SETTING}=true"
            )
        if self._mode != "explicit":
            raise InvalidInput(
                "model files can be uploaded only under NOGRAD_MODEL_CONTROL=explicit "
                f"(now {self._mode!r})"
            )
        if upload.config is None:
            raise PollFailed("load parameter 'config' must be specified for model file override")
        paths = {_inside(path): content for path, content in upload.files.items()}
        try:
            config = config_text(name, upload.config)
        except ConfigTooDeep as exc:
            raise InvalidInput(str(exc)) from exc
        except ValueError as exc:
            raise PollFailed(str(exc)) from exc
        self._check_room(name, upload.size)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._staging()))
        except OSError as exc:
            raise PollFailed(f"the upload folder could not be written: {exc.strerror}") from exc
        try:
            for path, content in paths.items():
                target = staging.joinpath(*path.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            (staging / CONFIG_FILE).write_text(config, encoding="utf-8")
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise PollFailed(f"the model's files could not be written: {exc.strerror}") from exc
            raise
        return staging

    def _check_room(self, name: str, size: int) -> None:
        """Refuse an upload that would keep more uploads or bytes than the bounds: every other
        model's upload counts, and so does every upload being written or loaded."""
        if self._bounds is None:
            return
        others = [p for p in self._kept() if p.name != name]
        if len(others) + 1 > self._bounds.max_uploads:
            raise UploadsFull(
                f"the server keeps {len(others)} uploaded models, the most it keeps "
                f"(NOGRAD_MAX_UPLOADS={self._bounds.max_uploads}): unload one first"
            )
        held = sum(_bytes_under(p) for p in others) + _bytes_under(self.folder / STAGING_FOLDER)
        if held + size > self._bounds.max_bytes:
            raise UploadsFull(
                f"these files ({size} bytes) would make the uploads kept {held + size} bytes, "
                f"over the limit of {self._bounds.max_bytes} bytes (NOGRAD_MAX_UPLOAD_BYTES): "
                "unload an uploaded model first"
            )

    def _kept(self) -> list[Path]:
        if self._folder is None or not self._folder.is_dir():
            return []
        return [p for p in self._folder.iterdir() if p.is_dir() and p.name != STAGING_FOLDER]

    def place(self, name: str, staged: Path | None) -> Placement:
        """Serve the ``staged`` files (None: the repository's folder) for the next read of model
        ``name``; the upload they replace is set aside until the load is kept or undone."""
        if staged is None and not (self._folder and (self._folder / name).exists()):
            return Placement(Path(), None, placed=False)  # no upload to set aside
        current = self.folder / name
        aside = None
        try:
            if current.exists():
                aside = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._staging()))
                os.replace(current, aside)
            if staged is not None:
                os.replace(staged, current)
        except OSError as exc:
            if aside is not None and not current.exists():
                os.replace(aside, current)
            raise PollFailed(
                f"the model's files could not be put in place: {exc.strerror}"
            ) from exc
        return Placement(current, aside, staged is not None)

    @contextlib.asynccontextmanager
    async def placed(
        self,
        name: str,
        files: str | None,
        registry: ModelRegistry,
        in_repository: Callable[[str], bool],
    ) -> AsyncIterator[None]:
        """While the block loads model ``name``, the ``files`` a load call staged in place of
        its upload (``""``: none, the repository's folder; None: the upload left as it is).
        Kept if a version of them serves; else taken away, the earlier upload put back, before
        any sibling worker reads them, and a model nothing else holds leaves no index row."""
        if files is None:
            yield
            return
        staged = Path(files) if files else None
        before = dict(registry.versions.get(name, {}))
        placement = await asyncio.to_thread(self.place, name, staged)
        try:
            yield
        except BaseException:
            now = registry.versions.get(name, {})
            if any(model is not before.get(version) for version, model in now.items()):
                await asyncio.to_thread(placement.keep)
                raise
            await asyncio.to_thread(placement.undo)
            if staged is not None and not now and not self.holds(name) and not in_repository(name):
                registry.unloaded.pop(name, None)
            raise
        await asyncio.to_thread(placement.keep)

    def _staging(self) -> Path:
        staging = self.folder / STAGING_FOLDER
        staging.mkdir(parents=True, exist_ok=True)
        return staging

    def discard(self, staged: Path) -> None:
        """Remove files staged for a load that never placed them (refused, or cancelled)."""
        shutil.rmtree(staged, ignore_errors=True)

    def recorded(self, served: Wanted, find: Finder) -> list[VersionSource]:
        """The uploaded versions of ``served`` (what the workers serve, as the last control call
        recorded it), read again by a worker that starts after the upload; one that cannot be
        read is logged and left out."""
        versions: list[VersionSource] = []
        for name in filter(self.holds, served):
            try:
                versions.extend(find(name, None, dict(served[name])).versions.values())
            except (InvalidInput, ModelNotFound) as exc:
                logger.error("uploaded model %s not served by this worker: %s", name, exc)
        return versions

    def remove(self, name: str) -> None:
        """Forget model ``name``'s upload: its next load reads the repository's folder."""
        if self._folder is not None:
            shutil.rmtree(self._folder / name, ignore_errors=True)

    def close(self) -> None:
        if self._owned and self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue  # removed while counted (an upload of another call finishing)
    return total


def _inside(key: str) -> PurePosixPath:
    """A ``file:`` parameter's path, checked to stay inside the model's folder."""
    text = key[len(FILE_PREFIX) :]
    if "\0" in text:
        raise InvalidInput(f"invalid file parameter {key!r}: a path may not hold a NUL character")
    path = PurePosixPath(text)
    if not text or path.is_absolute() or any(part in ("", ".", "..") for part in path.parts):
        raise PollFailed(
            f"invalid file parameter {key!r}: its path must stay within the model's folder"
        )
    for part in path.parts:
        if len(part.encode()) > NAME_MAX:
            raise PollFailed(
                f"invalid file parameter: a name of {len(part.encode())} bytes in its path is "
                f"longer than the file system's {NAME_MAX}"
            )
    if path == PurePosixPath(CONFIG_FILE):
        raise PollFailed(f"invalid file parameter {key!r}: the config is sent as 'config'")
    return path


def repository_of(configured: Path, directory: Path) -> Path:
    """The folder a model's files must stay in: the upload folder for a model uploaded with its
    load call, else the configured repository (an archive's sample request is looked for there
    too)."""
    resolved = directory.resolve()
    for root in UPLOAD_ROOTS:
        if resolved.is_relative_to(root.resolve()):
            return root
    return configured
