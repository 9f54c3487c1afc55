"""TorchServe's management calls that change models, answered as TorchServe's frontend answers
them (``ManagementRequestHandler``, ``ApiUtils``, ``ModelArchive.downloadModel``): register an
archive of the repository (``POST /models?url=...``), scale its workers (``PUT /models/{m}``) and
unregister it (``DELETE /models/{m}``). Registering and unregistering go through model control,
so every worker of the server agrees; scaling is accepted and recorded in every worker, so
``GET /models/{m}`` reports the workers asked for, as nograd runs one instance of a model per
worker process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from nograd.formats.torchserve.api.documents import archive_of
from nograd.formats.torchserve.reading.archives import SUFFIX, describe
from nograd.schema.config import ConfigError
from nograd.serving.calls.server_paths import without_server_paths
from nograd.serving.control.model_control import ModelControl
from nograd.serving.control.repository import archive_path, model_folder, read_archive_source
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import ControlRefused, InvalidInput, LoadFailed, ModelNotFound

logger = logging.getLogger(__name__)

ACCEPTED: Final = "Processing worker updates..."
"""TorchServe's answer (202) to a call that is not ``synchronous``."""
PEER_OP: Final = "torchserve-workers"
"""The sibling workers' call that records a model's workers (``nograd.serving.control.peers``)."""
Workers = tuple[int, int]
"""A model's ``minWorkers`` and ``maxWorkers``."""


@dataclass(frozen=True)
class Answer:
    """A TorchServe ``StatusResponse``: its HTTP status and its ``status`` text."""

    code: int
    status: str


class ManagementError(Exception):
    """A refused management call, as TorchServe's error body: status, exception type, message."""

    def __init__(self, code: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind
        self.message = message


def _not_found(message: str) -> ManagementError:
    return ManagementError(404, "ModelNotFoundException", message)


class TorchServeManagement:
    """The management calls over one process's model control and data plane."""

    def __init__(self, control: ModelControl, plane: DataPlane) -> None:
        self._control = control
        self._plane = plane
        self._registering: set[str] = set()
        """Models whose registration is loading (not ``synchronous``): a second one is a 409."""
        self._tasks: set[asyncio.Task[None]] = set()
        now = datetime.now(UTC)
        self.started = now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
        """When this process began serving, as TorchServe writes a worker's ``startTime``."""
        self.workers: dict[str, Workers] = {}
        """Each model's workers as the last register or scale call set them, alike in every
        worker of the server: TorchServe's describe reports them (until unregistered)."""
        if control.peers is not None:
            control.peers.routes[PEER_OP] = self._from_peer

    def _require_control(self) -> None:
        """TorchServe answers 405 when its model API is disabled; nograd says which setting."""
        mode = self._control.mode
        if mode != "explicit":
            raise ManagementError(
                405,
                "MethodNotAllowedException",
                "Requested method is not allowed: registering and unregistering models needs "
                f"NOGRAD_MODEL_CONTROL=explicit (it is {mode!r}"
                + (
                    "; in poll mode, add or remove the .mar file instead)"
                    if mode == "poll"
                    else ")"
                ),
            )

    def _archive_file(self, url: str | None) -> Path:
        """The archive ``url`` names in the repository; anything else refused as TorchServe
        refuses a url it cannot use (a download is a url no pattern allows)."""
        if url is None:
            raise ManagementError(400, "BadRequestException", "Parameter url is required.")
        if not url:
            raise _not_found("empty url")
        if ".." in url:
            raise _not_found(f"Relative path is not allowed in url: {url}")
        if "://" in url:
            raise _not_found(f"Given URL {url} does not match any allowed URL(s)")
        path = self._control.root / url
        if "/" in url or "\\" in url or not url.endswith(SUFFIX) or not path.is_file():
            logger.warning(
                "TorchServe register of %r: not a %s file directly in the model repository %s "
                "(nograd registers an archive of its repository, named by its file name, and "
                "downloads nothing)",
                url,
                SUFFIX,
                self._control.root,
            )
            raise _not_found(f"Model not found at: {url}")
        return path

    async def register(
        self, url: str | None, model_name: str | None, initial_workers: int, synchronous: bool
    ) -> Answer:
        """Load the archive ``url`` on every worker: 200 once it serves (``synchronous``), or
        202 at once while it loads."""
        self._require_control()
        path = self._archive_file(url)
        store = self._plane.archive_store
        root = self._control.root
        loop = asyncio.get_running_loop()
        try:
            source = await loop.run_in_executor(None, read_archive_source, path, store)
            holder = await loop.run_in_executor(None, archive_path, root, source.name, store)
        except ConfigError as exc:
            raise ManagementError(400, "InvalidModelException", self._shown(exc)) from exc
        name = source.name
        if model_name and model_name != name:
            raise ManagementError(
                400,
                "BadRequestException",
                f"model_name {model_name!r} differs from the archive's modelName {name!r}: "
                "nograd serves an archive under the name its manifest gives",
            )
        archive = describe(source.directory)
        if name in self._plane.registry.versions or name in self._registering:
            raise ManagementError(
                409,
                "ConflictStatusException",
                f"Model version {archive.version} is already registered for model {name}",
            )
        if holder != path or model_folder(root, name) is not None:
            raise ManagementError(
                409,
                "ConflictStatusException",
                f"model {name!r} is also defined by another file or folder of the repository",
            )
        low, high = archive.setting("minWorkers", 0), archive.setting("maxWorkers", 0)
        if not 0 < low <= high:
            low = high = max(initial_workers, 0)
        self._registering.add(name)
        try:
            await self._record(name, (low, high))
        except BaseException:
            self._registering.discard(name)
            raise
        if not synchronous:
            task = asyncio.create_task(self._load_logged(name, archive.version))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return Answer(202, ACCEPTED)
        try:
            await self._load(name, archive.version)
        except ManagementError:
            await self._record(name, None)
            raise
        finally:
            self._registering.discard(name)
        registered = f'Model "{name}" Version: {archive.version} registered with {low}'
        if low <= 0:
            return Answer(200, f"{registered} initial workers. {_SCALE_HINT}")
        return Answer(200, f"{registered} initial workers")

    async def _load(self, name: str, version: str) -> None:
        try:
            await self._control.load(name)
        except (InvalidInput, ControlRefused) as exc:
            raise ManagementError(400, "InvalidModelException", self._shown(exc)) from exc
        except (LoadFailed, ModelNotFound) as exc:
            raise ManagementError(
                500,
                "InternalServerException",
                f"Failed to start workers for model {name} version: {version}: {self._shown(exc)}",
            ) from exc

    def _shown(self, exc: Exception) -> str:
        """A failure as the client reads it, without the server's folders (logged whole)."""
        shown = without_server_paths(str(exc), self._control.uploads.server_paths())
        if shown != str(exc):
            logger.info("TorchServe register: %s", exc)
        return shown

    async def _load_logged(self, name: str, version: str) -> None:
        try:
            await self._load(name, version)
        except ManagementError as exc:
            logger.error("TorchServe register of %s: %s", name, exc.message)
            await self._record(name, None)
        finally:
            self._registering.discard(name)

    def _version_checked(self, name: str, version: str | None) -> None:
        """404s as TorchServe's: the model, then the version (the archive's own string)."""
        versions = self._plane.registry.versions.get(name)
        if not versions:
            raise _not_found(f"Model not found: {name}")
        if version is None:
            return
        own = {a.version if (a := archive_of(m)) else m.version for m in versions.values()}
        if version not in own:
            raise ManagementError(
                404,
                "ModelVersionNotFoundException",
                f"Model version: {version} does not exist for model: {name}",
            )

    async def scale(
        self,
        name: str,
        version: str | None,
        min_worker: int,
        max_worker: int,
        synchronous: bool,
    ) -> Answer:
        """Accepted and recorded, so describe reports the workers asked for (TorchServe sets
        them before it answers, ``synchronous`` or not); each nograd worker process still runs
        one instance of the model."""
        if max_worker < min_worker:
            raise ManagementError(
                400, "BadRequestException", "max_worker cannot be less than min_worker."
            )
        self._version_checked(name, version)
        await self._record(name, (min_worker, max_worker))
        logger.info(
            "TorchServe scale of %s to min_worker=%d max_worker=%d: recorded and reported; "
            "nograd runs one instance per worker process (NOGRAD_WORKERS) and batches requests "
            "instead",
            name,
            min_worker,
            max_worker,
        )
        if not synchronous:
            return Answer(202, ACCEPTED)
        scaled = f"Workers scaled to {min_worker} for model: {name}"
        return Answer(200, scaled if version is None else f"{scaled}, version: {version}")

    async def unregister(self, name: str, version: str | None) -> Answer:
        """Unload the model on every worker once its accepted requests are answered."""
        self._require_control()
        self._version_checked(name, version)
        try:
            await self._control.unload(name)
        except ModelNotFound as exc:
            raise _not_found(f"Model not found: {name}") from exc
        await self._record(name, None)
        return Answer(200, f'Model "{name}" unregistered')

    async def _record(self, name: str, workers: Workers | None) -> None:
        """Set (None: forget) a model's workers here and in every sibling worker, one change at
        a time server-wide; a sibling that cannot take it is logged."""
        self._set_workers(name, workers)
        peers = self._control.peers
        if peers is None:
            return
        call = {"op": PEER_OP, "name": name, "workers": None if workers is None else list(workers)}
        async with peers.exclusive():
            failures = await peers.broadcast(call)
        for worker, error in sorted(failures.items()):
            logger.error("TorchServe workers of %s not recorded by %s: %s", name, worker, error)

    def _set_workers(self, name: str, workers: Workers | None) -> None:
        if workers is None:
            self.workers.pop(name, None)
        else:
            self.workers[name] = workers

    async def _from_peer(self, call: dict[str, Any]) -> str | None:
        workers = call.get("workers")
        if workers is not None and not (
            isinstance(workers, list) and len(workers) == 2 and all(type(w) is int for w in workers)
        ):
            return f"malformed workers {workers!r}"
        self._set_workers(
            str(call.get("name")), None if workers is None else (workers[0], workers[1])
        )
        return None


_SCALE_HINT: Final = "Use scale workers API to add workers for the model."
