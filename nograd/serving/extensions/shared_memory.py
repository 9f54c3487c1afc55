"""Triton's system shared-memory extension in the serving core: the regions clients registered
(a POSIX shared-memory object, ``/dev/shm/<key>``, with its offset and byte size), read for
inputs and written for outputs by either front, with every bound checked before a byte moves.

With several workers a registration must hold in every worker (a client's next request may land
on any): the worker that takes a call applies it, then has its siblings apply it over the model
control channel (``nograd.serving.control.peers``) under the server-wide control lock, and records
the registrations in the shared state, which a worker started later (a restart after a crash) opens
before it serves. A sibling that cannot open a region undoes the whole registration.

Regions belong to their caller (``SharedMemoryLimits``): the id of the API key that registered
one (a digest, never the key), or one shared namespace without keys; a caller sees, uses and
unregisters only its own. A client may shrink its object after registering (``ftruncate``):
nothing is mapped, every copy is a ``pread``/``pwrite`` on the region's one file descriptor, so
a shrunk object is a short read answered 400, never a SIGBUS.

CUDA regions (``nograd.serving.extensions.cuda_shared_memory``) share the table and its names with
system regions, as in Triton: a name is registered as one kind or the other, an input or output
names a region of either kind, and the status and unregister calls of one kind leave the other
alone.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from nograd.host.cuda_ipc import CudaUnavailable, cuda_runtime
from nograd.serving.control.peers import Peers
from nograd.serving.errors import (
    AlreadyExists,
    InvalidInput,
    LimitExceeded,
    LoadFailed,
    RegionNotFound,
    Unsupported,
)
from nograd.serving.extensions import cuda_shared_memory as cuda
from nograd.serving.extensions.system_region import SYSTEM, Kind, Region, open_region

logger = logging.getLogger(__name__)

STATE_FILE: Final = "shared_memory.json"
PEER_OP: Final = "shared_memory"
_TITLES: Final = {SYSTEM: "system", cuda.KIND: "CUDA"}
SHARED: Final = ""
"""The caller of every call on a server without API keys: one namespace for all clients."""
DEFAULT_MAX_REGIONS: Final = 256


@dataclass(frozen=True)
class SharedMemoryLimits:
    """What the extension lets clients do (``NOGRAD_SHARED_MEMORY*`` settings)."""

    enabled: bool = True
    max_regions: int = DEFAULT_MAX_REGIONS
    """Regions (both kinds, every caller) one server holds; each holds a file descriptor or a
    device handle in every worker."""
    key_prefix: str = ""
    """The start every system region's object name must have (``/`` aside); empty: any."""


StoredRegion = Region | cuda.CudaRegion
Slot = tuple[str, str]
"""A region's place in the table: its caller, its name."""


class SharedMemory:
    """This worker's registered shared-memory regions (system and CUDA), kept alike in every
    worker, each its caller's own."""

    def __init__(
        self,
        peers: Peers | None = None,
        cuda_opener: cuda.CudaOpener = cuda_runtime,
        limits: SharedMemoryLimits | None = None,
    ) -> None:
        self._regions: dict[Slot, StoredRegion] = {}
        self._peers = peers
        self._cuda_opener = cuda_opener
        self.limits = limits or SharedMemoryLimits()
        if peers is not None:
            peers.routes[PEER_OP] = self._from_peer

    def check_served(self, kind: Kind = SYSTEM) -> None:
        if not self.limits.enabled:
            raise Unsupported(
                f"{_TITLES[kind]} shared memory is turned off on this server "
                "(NOGRAD_SHARED_MEMORY=off)"
            )

    # ------------------------------------------------------------------ registry
    def status(
        self, name: str | None = None, kind: Kind = SYSTEM, caller: str = SHARED
    ) -> list[dict[str, Any]]:
        """The caller's regions of one kind, or the one named (Triton's errors for an unknown
        name, or one of the other kind)."""
        self.check_served(kind)
        if name is None:
            owned = ((owner, r) for (owner, _), r in self._regions.items())
            return [r.status() for owner, r in owned if owner == caller and r.kind == kind]
        region = self._regions.get((caller, name))
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
        self.check_served(cuda.KIND)
        try:
            await asyncio.to_thread(self._cuda_opener)
        except CudaUnavailable as exc:
            raise InvalidInput(cuda.cuda_refusal(name)) from exc

    async def register(
        self, name: str, key: Any, offset: Any, byte_size: Any, caller: str = SHARED
    ) -> None:
        """Register a system region for ``caller`` in every worker, or in none (the error says
        which worker failed)."""
        self.check_served()
        await self._register(
            {
                "kind": SYSTEM,
                "caller": caller,
                "name": name,
                "key": key,
                "offset": offset,
                "byte_size": byte_size,
            }
        )

    async def register_cuda(
        self, name: str, raw_handle: bytes, device_id: Any, byte_size: Any, caller: str = SHARED
    ) -> None:
        """Register a CUDA region (a client's IPC handle) for ``caller`` in every worker, or in
        none."""
        await self.require_cuda(name)
        handle = base64.b64encode(raw_handle).decode()
        await self._register(
            {
                "kind": cuda.KIND,
                "caller": caller,
                "name": name,
                "raw_handle": handle,
                "device_id": device_id,
                "byte_size": byte_size,
            }
        )

    async def _register(self, record: dict[str, Any]) -> None:
        slot = (str(record["caller"]), str(record["name"]))
        if self._peers is None:
            await self._add_off_loop(record, capped=True)
            return
        async with self._peers.exclusive():
            await self._add_off_loop(record, capped=True)
            failures = await self._peers.broadcast({"op": PEER_OP, "action": "register"} | record)
            if failures:
                self._drop(slot[1], None, slot[0])
                await self._peers.broadcast(
                    {"op": PEER_OP, "action": "unregister", "name": slot[1], "caller": slot[0]}
                )
                detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
                raise LoadFailed(f"shared memory region '{slot[1]}' not registered: {detail}")
            self._record()

    async def unregister(
        self, name: str | None = None, kind: Kind = SYSTEM, caller: str = SHARED
    ) -> None:
        """Unregister one of the caller's regions of ``kind`` (None: every one) in every
        worker; an unknown name, or one of the other kind, is no error, as in Triton."""
        self.check_served(kind)
        self._drop(name, kind, caller)
        if self._peers is None:
            return
        async with self._peers.exclusive():
            call = {"op": PEER_OP, "action": "unregister", "name": name, "kind": kind}
            failures = await self._peers.broadcast(call | {"caller": caller})
            self._record()
        if failures:
            detail = "; ".join(f"{w}: {error}" for w, error in sorted(failures.items()))
            raise LoadFailed(
                f"Failed to unregister the following {_TITLES[kind]} shared memory: {detail}"
            )

    def _taken(self, slot: Slot, capped: bool) -> None:
        if slot in self._regions:
            raise AlreadyExists(f"shared memory region '{slot[1]}' already in manager")
        cap = self.limits.max_regions
        if capped and len(self._regions) >= cap:
            raise LimitExceeded(
                f"failed to register shared memory region '{slot[1]}': this server holds at "
                f"most {cap} shared memory regions (NOGRAD_MAX_SHARED_MEMORY_REGIONS); "
                "unregister one first"
            )

    def _open(self, record: dict[str, Any]) -> StoredRegion:
        """Open the region ``record`` describes, leaving the table alone."""
        name = str(record["name"])
        if record.get("kind", SYSTEM) == cuda.KIND:
            handle = cuda.decode_handle(name, record.get("raw_handle"))
            return cuda.open_region(
                self._cuda_opener, name, handle, record.get("device_id"), record.get("byte_size")
            )
        key, offset = record.get("key"), record.get("offset", 0)
        return open_region(name, key, offset, record.get("byte_size"), self.limits.key_prefix)

    def _insert(self, slot: Slot, region: StoredRegion, capped: bool) -> None:
        try:
            self._taken(slot, capped)  # again: registered meanwhile under the same name
        except BaseException:
            region.close()
            raise
        self._regions[slot] = region

    def _add(self, record: dict[str, Any]) -> None:
        slot = (str(record.get("caller", SHARED)), str(record["name"]))
        self._taken(slot, capped=False)
        self._insert(slot, self._open(record), capped=False)

    async def _add_off_loop(self, record: dict[str, Any], capped: bool) -> None:
        """``_add`` with the opening in a thread: a CUDA handle's first opening creates the
        device's context, which takes long. ``capped``: the worker that took the call refuses
        past ``max_regions`` (its siblings hold the same table)."""
        slot = (str(record.get("caller", SHARED)), str(record["name"]))
        self._taken(slot, capped)
        self._insert(slot, await asyncio.to_thread(self._open, record), capped)

    def _drop(self, name: str | None, kind: Kind | None, caller: str | None) -> None:
        """Close the caller's (None: anyone's) region named (None: every one) when of ``kind``
        (None: either)."""
        for slot in list(self._regions):
            owner, each = slot
            if caller not in (None, owner) or name not in (None, each):
                continue
            region = self._regions[slot]
            if kind in (None, region.kind):
                del self._regions[slot]
                region.close()

    def close(self) -> None:
        """Close every region (the server stops)."""
        self._drop(None, None, None)

    # ------------------------------------------------------------------ workers
    async def _from_peer(self, call: dict[str, Any]) -> str | None:
        try:
            caller = str(call.get("caller", SHARED))
            if call.get("action") == "register":
                self._drop(str(call["name"]), None, caller)  # the calling worker holds the name
                await self._add_off_loop(call, capped=False)
            else:
                name, kind = call.get("name"), call.get("kind")
                self._drop(None if name is None else str(name), kind, caller)
        except (InvalidInput, AlreadyExists) as exc:
            return str(exc)
        return None

    def _record(self) -> None:
        assert self._peers is not None
        path = self._peers.directory / STATE_FILE
        temporary = path.with_suffix(".tmp")
        recorded = [r.record() | {"caller": owner} for (owner, _), r in self._regions.items()]
        temporary.write_text(json.dumps(recorded))
        temporary.replace(path)

    def restore(self) -> None:
        """Open what the workers share (a worker started after registrations); a region that no
        longer opens is logged and left out."""
        if self._peers is None or not self.limits.enabled:
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
    def _within(self, caller: str, name: str, offset: int, byte_size: int) -> StoredRegion:
        """The caller's region, once ``offset`` and ``byte_size`` lie within it (Triton's
        errors; another caller's region is as unknown as one never registered)."""
        self.check_served()
        region = self._regions.get((caller, name))
        if region is None:
            raise RegionNotFound(f"Unable to find shared memory region: '{name}'")
        if offset >= region.byte_size:
            raise InvalidInput(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > region.byte_size:
            raise InvalidInput(f"Invalid offset + byte size for shared memory region: '{name}'")
        return region

    def read(self, name: str, offset: int, byte_size: int, caller: str = SHARED) -> bytearray:
        """A copy of ``byte_size`` bytes at ``offset`` in the caller's region ``name``
        (writable: torch takes the tensors built on it as they are)."""
        return self._within(caller, name, offset, byte_size).read(offset, byte_size)

    def write(
        self,
        name: str,
        offset: int,
        byte_size: int,
        data: bytes | memoryview,
        what: str,
        caller: str = SHARED,
    ) -> None:
        """Write an output's ``data`` at ``offset`` in the caller's region ``name``, within the
        ``byte_size`` the request gave it (Triton's error when it holds less)."""
        if len(data) > byte_size:
            raise InvalidInput(
                f"shared memory size specified with the request for output '{what}' "
                f"({byte_size} bytes) should be at least {len(data)} bytes to hold the results"
            )
        self._within(caller, name, offset, byte_size).write(offset, data)

    def of_caller(self, caller: str, hold: Callable[[int], None]) -> CallerRegions:
        """One call's view of its caller's regions (``nograd.protocol.shared_memory.Regions``)."""
        return CallerRegions(self, caller, hold)


class CallerRegions:
    """The regions one call may use: its caller's only; the bytes of its BYTES inputs, which no
    declared shape sizes, are drawn first by ``hold``, which refuses past the request's
    limits."""

    def __init__(self, regions: SharedMemory, caller: str, hold: Callable[[int], None]):
        self._regions, self._caller, self._hold = regions, caller, hold

    def hold(self, byte_size: int) -> None:
        self._regions.check_served()
        self._hold(byte_size)

    def read(self, name: str, offset: int, byte_size: int) -> bytearray:
        return self._regions.read(name, offset, byte_size, self._caller)

    def write(
        self, name: str, offset: int, byte_size: int, data: bytes | memoryview, what: str
    ) -> None:
        self._regions.write(name, offset, byte_size, data, what, self._caller)
