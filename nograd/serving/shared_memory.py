"""Triton's system shared-memory extension in the serving core: the regions clients registered
(a POSIX shared-memory object, ``/dev/shm/<key>``, mapped with its offset and byte size), read
for inputs and written for outputs by either front, with every bound checked before a byte moves.

With several workers a registration must hold in every worker (a client's next request may land
on any): the worker that takes a call applies it, then has its siblings apply it over the model
control channel (``nograd.serving.peers``) under the server-wide control lock, and records the
registrations in the shared state, which a worker started later (a restart after a crash) maps
before it serves. A sibling that cannot map a region undoes the whole registration.

A client may shrink its object after registering (``ftruncate``); touching mapped pages past the
end would kill the process (SIGBUS), so every access first checks the object's current size.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nograd.serving.errors import AlreadyExists, InvalidInput, LoadFailed, RegionNotFound
from nograd.serving.peers import Peers

logger = logging.getLogger(__name__)

SHM_ROOT: Final = Path("/dev/shm")
STATE_FILE: Final = "shared_memory.json"
PEER_OP: Final = "shared_memory"


def cuda_refusal(name: str) -> str:
    """Triton's answer to registering a CUDA region on a server without GPU support."""
    return f"failed to register CUDA shared memory region: '{name}', GPUs not supported"


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    mapped: mmap.mmap
    """The object from its start to ``offset + byte_size`` (mmap offsets must be page-aligned)."""

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def close(self) -> None:
        try:
            self.mapped.close()
        finally:
            os.close(self.fd)


def _object_path(key: str) -> Path | None:
    """The file of a POSIX shm key (``/name`` or ``name``); None for one that names no object
    directly in /dev/shm (a path, ``..``)."""
    name = key.removeprefix("/")
    if not name or "/" in name or name in (".", ".."):
        return None
    return SHM_ROOT / name


def _whole(value: Any, field: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(
            f"failed to register shared memory region '{name}': {field} must be a non-negative "
            f"integer, got {value!r}"
        )
    return value


def map_region(name: str, key: Any, offset: Any, byte_size: Any) -> Region:
    """Open and map one region, its bounds checked against the object's size (Triton's errors)."""
    if not isinstance(key, str):
        raise InvalidInput(
            f"failed to register shared memory region '{name}': key must be a string"
        )
    offset = _whole(offset, "offset", name)
    byte_size = _whole(byte_size, "byte_size", name)
    path = _object_path(key)
    try:
        if path is None:
            raise FileNotFoundError(key)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the key
        raise InvalidInput(f"Unable to open shared memory region: '{key}'") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(f"Invalid shared memory region: '{key}'")
        if byte_size == 0 or offset + byte_size > info.st_size:
            raise InvalidInput(f"failed to register shared memory region '{name}': invalid args")
        mapped = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED)
    except (OSError, OverflowError, ValueError) as exc:
        os.close(fd)
        raise InvalidInput(f"failed to register shared memory region '{name}': {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return Region(name, key, offset, byte_size, fd, mapped)


class SharedMemory:
    """This worker's registered system shared-memory regions, kept alike in every worker."""

    def __init__(self, peers: Peers | None = None) -> None:
        self._regions: dict[str, Region] = {}
        self._peers = peers
        if peers is not None:
            peers.routes[PEER_OP] = self._from_peer

    # ------------------------------------------------------------------ registry
    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        if name is None:
            return [region.status() for region in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    async def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Register a region in every worker, or in none (the error says which worker failed)."""
        call = {"op": PEER_OP, "action": "register", "name": name, "key": key}
        call |= {"offset": offset, "byte_size": byte_size}
        if self._peers is None:
            self._add(name, key, offset, byte_size)
            return
        async with self._peers.exclusive():
            self._add(name, key, offset, byte_size)
            failures = await self._peers.broadcast(call)
            if failures:
                self._drop(name)
                await self._peers.broadcast({"op": PEER_OP, "action": "unregister", "name": name})
                detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
                raise LoadFailed(f"shared memory region '{name}' not registered: {detail}")
            self._record()

    async def unregister(self, name: str | None = None) -> None:
        """Unregister one region (None: every one) in every worker; an unknown name is no error,
        as in Triton."""
        self._drop(name)
        if self._peers is None:
            return
        async with self._peers.exclusive():
            failures = await self._peers.broadcast(
                {"op": PEER_OP, "action": "unregister", "name": name}
            )
            self._record()
        if failures:
            detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
            raise LoadFailed(f"Failed to unregister the following system shared memory: {detail}")

    def _add(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        self._regions[name] = map_region(name, key, offset, byte_size)

    def _drop(self, name: str | None) -> None:
        names = list(self._regions) if name is None else [name]
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                region.close()

    def close(self) -> None:
        """Unmap every region (the server stops)."""
        self._drop(None)

    # ------------------------------------------------------------------ workers
    async def _from_peer(self, call: dict[str, Any]) -> str | None:
        try:
            if call.get("action") == "register":
                name = str(call["name"])
                self._drop(name)  # the calling worker holds the name: a stale one here goes
                self._add(name, call.get("key"), call.get("offset"), call.get("byte_size"))
            else:
                name_or_all = call.get("name")
                self._drop(None if name_or_all is None else str(name_or_all))
        except (InvalidInput, AlreadyExists) as exc:
            return str(exc)
        return None

    def _record(self) -> None:
        assert self._peers is not None
        path = self._peers.directory / STATE_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps([r.status() for r in self._regions.values()]))
        temporary.replace(path)

    def restore(self) -> None:
        """Map what the workers share (a worker started after registrations); a region that no
        longer maps is logged and left out."""
        if self._peers is None:
            return
        try:
            recorded = json.loads((self._peers.directory / STATE_FILE).read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            logger.exception("shared memory state unreadable; no region registered")
            return
        for entry in recorded if isinstance(recorded, list) else []:
            try:
                name = str(entry["name"])
                self._add(name, entry["key"], entry["offset"], entry["byte_size"])
            except (KeyError, TypeError, InvalidInput, AlreadyExists) as exc:
                logger.error("shared memory region not restored in this worker: %s", exc)

    # ------------------------------------------------------------------ data
    def _within(self, name: str, offset: int, byte_size: int) -> Region:
        """The region, once ``offset`` and ``byte_size`` lie within it and its object still
        holds them (Triton's errors)."""
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"Unable to find shared memory region: '{name}'")
        if offset >= region.byte_size:
            raise InvalidInput(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > region.byte_size:
            raise InvalidInput(f"Invalid offset + byte size for shared memory region: '{name}'")
        if os.fstat(region.fd).st_size < region.offset + offset + byte_size:
            raise InvalidInput(
                f"shared memory region '{name}': its object '{region.key}' shrank below the "
                "registered size; register it again"
            )
        return region

    def read(self, name: str, offset: int, byte_size: int) -> bytearray:
        """A copy of ``byte_size`` bytes at ``offset`` in region ``name`` (writable: torch takes
        the tensors built on it as they are)."""
        region = self._within(name, offset, byte_size)
        start = region.offset + offset
        with memoryview(region.mapped) as whole, whole[start : start + byte_size] as part:
            return bytearray(part)

    def write(
        self, name: str, offset: int, byte_size: int, data: bytes | memoryview, what: str
    ) -> None:
        """Write an output's ``data`` at ``offset`` in region ``name``, within the ``byte_size``
        the request gave it (Triton's error when it holds less)."""
        if len(data) > byte_size:
            raise InvalidInput(
                f"shared memory size specified with the request for output '{what}' "
                f"({byte_size} bytes) should be at least {len(data)} bytes to hold the results"
            )
        region = self._within(name, offset, byte_size)
        start = region.offset + offset
        region.mapped[start : start + len(data)] = data
