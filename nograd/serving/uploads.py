"""Model files sent with a load call (Triton's ``file:<path>`` load parameters, with ``config``):
a Triton model folder written outside the repository, which the load (and every sibling worker)
reads in place of the repository's folder of that name until a load without files or an unload.

An uploaded model is code the caller chose (a Python model's ``model.py``), so uploads are off
unless ``NOGRAD_MODEL_UPLOADS`` is set, and only under ``NOGRAD_MODEL_CONTROL=explicit``. A folder
that cannot be written as sent answers as Triton does (``failed to poll from model repository``).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from nograd.formats.triton.reading.config import CONFIG_FILE
from nograd.formats.triton.reading.config_json import config_text
from nograd.serving.errors import InvalidInput, ModelNotFound, PollFailed
from nograd.serving.repository import ModelSource, Override, VersionSource, Wanted

logger = logging.getLogger(__name__)

Finder = Callable[[str, Override | None, dict[str, Override | None] | None], ModelSource]
"""How model control reads a model (``ModelControl._find``): name, override, wanted versions."""

FILE_PREFIX: Final = "file:"
NAME_MAX: Final = 255
"""The longest file or folder name the file system takes (Linux's NAME_MAX, in bytes)."""
SETTING: Final = "NOGRAD_MODEL_UPLOADS"
UPLOADS_FOLDER: Final = "uploads"
UPLOAD_ROOTS: set[Path] = set()
"""The upload folders of this process: a model read from one is bounded by it."""
"""The uploaded models' folder, in the folder the workers share."""


@dataclass(frozen=True)
class Upload:
    """A load call's model: its Triton config as JSON text (None: not sent) and its files by
    path within the model folder (``1/model.py``)."""

    config: str | None
    files: dict[str, bytes]


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

    def __init__(self, folder: Path | None, enabled: bool, mode: str) -> None:
        """``folder``: shared with the sibling workers (None: a private one, made when needed)."""
        self._folder = folder
        self._owned = folder is None
        if folder is not None:
            UPLOAD_ROOTS.add(folder)
        self._enabled = enabled
        self._mode = mode

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="nograd-uploads-"))
            UPLOAD_ROOTS.add(self._folder)
        return self._folder

    def holds(self, name: str) -> bool:
        return self._folder is not None and (self._folder / name / CONFIG_FILE).is_file()

    def write(self, name: str, upload: Upload) -> None:
        """Write ``upload`` as model ``name``'s folder, replacing an earlier upload whole. Checked
        first (nothing is written on a refusal): uploads on, a config sent, every path inside
        the model's folder and each of its names within ``NAME_MAX``."""
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
        except ValueError as exc:
            raise PollFailed(str(exc)) from exc
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.folder))
        except OSError as exc:
            raise PollFailed(f"the upload folder could not be written: {exc.strerror}") from exc
        try:
            for path, content in paths.items():
                target = staging.joinpath(*path.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            (staging / CONFIG_FILE).write_text(config, encoding="utf-8")
            self.remove(name)
            os.replace(staging, self.folder / name)
        except OSError as exc:
            raise PollFailed(f"the model's files could not be written: {exc.strerror}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)

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


def _inside(key: str) -> PurePosixPath:
    """A ``file:`` parameter's path, checked to stay inside the model's folder."""
    text = key[len(FILE_PREFIX) :]
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
