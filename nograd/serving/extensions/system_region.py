"""One system shared-memory region (a POSIX object, ``/dev/shm/<key>``, with its offset and
byte size): opened with its bounds checked, read and written with ``pread``/``pwrite`` on its one
file descriptor, never mapped, so an object a client shrinks is a 400, never a SIGBUS."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

from nograd.serving.errors import InvalidInput

SHM_ROOT: Final = Path("/dev/shm")
SYSTEM: Final = "system"
Kind = Literal["system", "cuda"]


def _unable_to_open(key: str) -> InvalidInput:
    """Triton's refusal of an object it cannot open: the one answer for an object missing, not
    a plain file, outside ``key_prefix`` or not readable, so no answer tells which."""
    return InvalidInput(f"Unable to open shared memory region: '{key}'")


@dataclass
class Region:
    """A system shared-memory region: its object's file descriptor, read and written with
    ``pread``/``pwrite`` (never mapped: a mapping's pages past a shrunk end raise SIGBUS)."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    kind: ClassVar[Kind] = SYSTEM

    def record(self) -> dict[str, Any]:
        """What another worker needs to open the same region."""
        return {"kind": SYSTEM} | self.status()

    def _shrank(self) -> InvalidInput:
        return InvalidInput(
            f"shared memory region '{self.name}': its object '{self.key}' shrank below the "
            "registered size; register it again"
        )

    def read(self, offset: int, byte_size: int) -> bytearray:
        """``byte_size`` bytes at ``offset`` read into a new buffer; an object that ends before
        them (shrunk since registered) is a 400 naming the region."""
        data = bytearray(byte_size)
        start = self.offset + offset
        done = 0
        with memoryview(data) as whole:
            while done < byte_size:
                got = os.preadv(self.fd, [whole[done:]], start + done)
                if got == 0:
                    raise self._shrank()
                done += got
        return data

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """``data`` written at ``offset``, once the object still holds it (a shrunk object is
        refused, not grown back)."""
        start = self.offset + offset
        if os.fstat(self.fd).st_size < start + len(data):
            raise self._shrank()
        with memoryview(data) as whole, whole.cast("B") as flat:
            done = 0
            while done < len(flat):
                done += os.pwrite(self.fd, flat[done:], start + done)

    def close(self) -> None:
        os.close(self.fd)


def _object_path(key: str, prefix: str) -> Path | None:
    """The file of a POSIX shm key (``/name`` or ``name``); None for one that names no object
    directly in /dev/shm (a path, ``..``) or whose name does not start with ``prefix``."""
    name = key.removeprefix("/")
    if not name or "/" in name or name in (".", "..") or not name.startswith(prefix):
        return None
    return SHM_ROOT / name


def _whole(value: Any, field: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(
            f"failed to register shared memory region '{name}': {field} must be a non-negative "
            f"integer, got {value!r}"
        )
    return value


def open_region(name: str, key: Any, offset: Any, byte_size: Any, prefix: str = "") -> Region:
    """Open one region, its bounds checked against the object's size (Triton's errors); an
    object that cannot be opened, whatever the reason, gets the same answer."""
    if not isinstance(key, str):
        raise InvalidInput(
            f"failed to register shared memory region '{name}': key must be a string"
        )
    offset = _whole(offset, "offset", name)
    byte_size = _whole(byte_size, "byte_size", name)
    path = _object_path(key, prefix.removeprefix("/"))
    try:
        if path is None:
            raise FileNotFoundError(key)
        # Non-blocking: a FIFO placed in /dev/shm must not hold the thread opening it.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the key
        raise _unable_to_open(key) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _unable_to_open(key)
        if byte_size == 0 or offset + byte_size > info.st_size:
            raise InvalidInput(f"failed to register shared memory region '{name}': invalid args")
    except BaseException:
        os.close(fd)
        raise
    return Region(name, key, offset, byte_size, fd)
