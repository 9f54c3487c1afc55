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

CUDA regions (``nograd.serving.cuda_shared_memory``) share the table and its names with system
regions, as in Triton: a name is registered as one kind or the other, an input or output names a
region of either kind, and the status and unregister calls of one kind leave the other alone.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

from nograd.host.cuda_ipc import CudaUnavailable, cuda_runtime
from nograd.serving import cuda_shared_memory as cuda
from nograd.serving.errors import AlreadyExists, InvalidInput, LoadFailed, RegionNotFound
from nograd.serving.peers import Peers

logger = logging.getLogger(__name__)

SHM_ROOT: Final = Path("/dev/shm")
STATE_FILE: Final = "shared_memory.json"
PEER_OP: Final = "shared_memory"
SYSTEM: Final = "system"
Kind = Literal["system", "cuda"]
_TITLES: Final = {SYSTEM: "system", cuda.KIND: "CUDA"}


@dataclass
class Region:
    """A system shared-memory region."""

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

    kind: ClassVar[Kind] = SYSTEM

    def record(self) -> dict[str, Any]:
        """What another worker needs to map the same region."""
        return {"kind": SYSTEM} | self.status()

    def still_holds(self, offset: int, byte_size: int) -> None:
        if os.fstat(self.fd).st_size < self.offset + offset + byte_size:
            raise InvalidInput(
                f"shared memory region '{self.name}': its object '{self.key}' shrank below the "
                "registered size; register it again"
            )

    def read(self, offset: int, byte_size: int) -> bytearray:
        start = self.offset + offset
        with memoryview(self.mapped) as whole, whole[start : start + byte_size] as part:
            return bytearray(part)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        start = self.offset + offset
        self.mapped[start : start + len(data)] = data

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


StoredRegion = Region | cuda.CudaRegion


class SharedMemory:
    """This worker's registered shared-memory regions (system and CUDA), kept alike in every
    worker."""

    def __init__(
        self, peers: Peers | None = None, cuda_opener: cuda.CudaOpener = cuda_runtime
    ) -> None:
        self._regions: dict[str, StoredRegion] = {}
        self._peers = peers
        self._cuda_opener = cuda_opener
        if peers is not None:
            peers.routes[PEER_OP] = self._from_peer

    # ------------------------------------------------------------------ registry
    def status(self, name: str | None = None, kind: Kind = SYSTEM) -> list[dict[str, Any]]:
        """The regions of one kind, or the one named (Triton's errors for an unknown name, or
        one of the other kind)."""
        if name is None:
            return [r.status() for r in self._regions.values() if r.kind == kind]
        region = self._regions.get(name)
        if region is None:
            what = "cuda" if kind == cuda.KIND else "system"
            raise RegionNotFound(f"Unable to find {what} shared memory region: '{name}'")
        if region.kind != kind:
            raise RegionNotFound(
                f"The region named '{name}' is registered as {_TITLES[region.kind]} shared "
                f"memory, not {_TITLES[kind]} shared memory"
            )
        return [region.status()]

    async def require_cuda(self, name: str) -> None:
        """Refuse, as Triton without GPU support does, unless this server sees a GPU (the first
        probe initialises CUDA: off the event loop)."""
        try:
            await asyncio.to_thread(self._cuda_opener)
        except CudaUnavailable as exc:
            raise InvalidInput(cuda.cuda_refusal(name)) from exc

    async def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Register a system region in every worker, or in none (the error says which worker
        failed)."""
        await self._register(
            {"kind": SYSTEM, "name": name, "key": key, "offset": offset, "byte_size": byte_size}
        )

    async def register_cuda(
        self, name: str, raw_handle: bytes, device_id: Any, byte_size: Any
    ) -> None:
        """Register a CUDA region (a client's IPC handle) in every worker, or in none."""
        await self.require_cuda(name)
        handle = base64.b64encode(raw_handle).decode()
        await self._register(
            {
                "kind": cuda.KIND,
                "name": name,
                "raw_handle": handle,
                "device_id": device_id,
                "byte_size": byte_size,
            }
        )

    async def _register(self, record: dict[str, Any]) -> None:
        name = record["name"]
        if self._peers is None:
            await self._add_off_loop(record)
            return
        async with self._peers.exclusive():
            await self._add_off_loop(record)
            failures = await self._peers.broadcast({"op": PEER_OP, "action": "register"} | record)
            if failures:
                self._drop(name, None)
                await self._peers.broadcast({"op": PEER_OP, "action": "unregister", "name": name})
                detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
                raise LoadFailed(f"shared memory region '{name}' not registered: {detail}")
            self._record()

    async def unregister(self, name: str | None = None, kind: Kind = SYSTEM) -> None:
        """Unregister one region of ``kind`` (None: every one) in every worker; an unknown name,
        or one of the other kind, is no error, as in Triton."""
        self._drop(name, kind)
        if self._peers is None:
            return
        async with self._peers.exclusive():
            failures = await self._peers.broadcast(
                {"op": PEER_OP, "action": "unregister", "name": name, "kind": kind}
            )
            self._record()
        if failures:
            detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
            raise LoadFailed(
                f"Failed to unregister the following {_TITLES[kind]} shared memory: {detail}"
            )

    def _taken(self, name: str) -> None:
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")

    def _open(self, record: dict[str, Any]) -> StoredRegion:
        """Map or open the region ``record`` describes, leaving the table alone."""
        name = str(record["name"])
        if record.get("kind", SYSTEM) == cuda.KIND:
            handle = cuda.decode_handle(name, record.get("raw_handle"))
            return cuda.open_region(
                self._cuda_opener, name, handle, record.get("device_id"), record.get("byte_size")
            )
        key, offset = record.get("key"), record.get("offset", 0)
        return map_region(name, key, offset, record.get("byte_size"))

    def _insert(self, region: StoredRegion) -> None:
        if region.name in self._regions:
            region.close()  # registered meanwhile under the same name
            self._taken(region.name)
        self._regions[region.name] = region

    def _add(self, record: dict[str, Any]) -> None:
        self._taken(str(record["name"]))
        self._insert(self._open(record))

    async def _add_off_loop(self, record: dict[str, Any]) -> None:
        """``_add`` with the opening in a thread: a CUDA handle's first opening creates the
        device's context, which takes long."""
        self._taken(str(record["name"]))
        self._insert(await asyncio.to_thread(self._open, record))

    def _drop(self, name: str | None, kind: Kind | None) -> None:
        """Close the region named (None: every one) when of ``kind`` (None: either)."""
        names = list(self._regions) if name is None else [name]
        for each in names:
            region = self._regions.get(each)
            if region is not None and kind in (None, region.kind):
                del self._regions[each]
                region.close()

    def close(self) -> None:
        """Unmap and close every region (the server stops)."""
        self._drop(None, None)

    # ------------------------------------------------------------------ workers
    async def _from_peer(self, call: dict[str, Any]) -> str | None:
        try:
            if call.get("action") == "register":
                self._drop(str(call["name"]), None)  # the calling worker holds the name
                await self._add_off_loop(call)
            else:
                name, kind = call.get("name"), call.get("kind")
                self._drop(None if name is None else str(name), kind)
        except (InvalidInput, AlreadyExists) as exc:
            return str(exc)
        return None

    def _record(self) -> None:
        assert self._peers is not None
        path = self._peers.directory / STATE_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps([r.record() for r in self._regions.values()]))
        temporary.replace(path)

    def restore(self) -> None:
        """Map and open what the workers share (a worker started after registrations); a region
        that no longer opens is logged and left out."""
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
                self._add(entry)
            except (KeyError, TypeError, InvalidInput, AlreadyExists) as exc:
                logger.error("shared memory region not restored in this worker: %s", exc)

    # ------------------------------------------------------------------ data
    def _within(self, name: str, offset: int, byte_size: int) -> StoredRegion:
        """The region, once ``offset`` and ``byte_size`` lie within it and (system regions) its
        object still holds them (Triton's errors)."""
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"Unable to find shared memory region: '{name}'")
        if offset >= region.byte_size:
            raise InvalidInput(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > region.byte_size:
            raise InvalidInput(f"Invalid offset + byte size for shared memory region: '{name}'")
        region.still_holds(offset, byte_size)
        return region

    def read(self, name: str, offset: int, byte_size: int) -> bytearray:
        """A copy of ``byte_size`` bytes at ``offset`` in region ``name`` (writable: torch takes
        the tensors built on it as they are)."""
        return self._within(name, offset, byte_size).read(offset, byte_size)

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
        self._within(name, offset, byte_size).write(offset, data)
