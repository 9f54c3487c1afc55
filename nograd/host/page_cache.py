"""Files kept in the operating system's page cache, or dropped from it (Linux ``posix_fadvise``).

A model evicted under on-demand control is often asked for again soon; its next load reads its
files again. Advising the kernel that they will be needed (``POSIX_FADV_WILLNEED``) reads back
any page it has dropped, ahead of the load, so the load reads memory rather than the disk. The
pages stay the kernel's to reclaim under memory pressure: nothing is pinned, and nothing counts
in the process's resident memory. Where there is no ``posix_fadvise`` (macOS) nothing is done.

This module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

CHUNK_BYTES: Final = 8 << 20
"""Bytes advised at a time: the kernel reads ahead at most a few megabytes per advice, so a
whole large file is advised piece by piece."""


def _advise(paths: Iterable[Path], advice: int, sync: bool = False) -> int:
    """``advice`` on each whole file of ``paths`` (written to disk first with ``sync``); the
    bytes of those advised."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone, or unreadable: the load will say so
        try:
            size = os.fstat(fd).st_size
            if sync:
                os.fsync(fd)
            for offset in range(0, size, CHUNK_BYTES):
                advise(fd, offset, CHUNK_BYTES, advice)
            total += size
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def keep_warm(paths: Iterable[Path]) -> int:
    """Ask the kernel to read back (asynchronously) the pages of ``paths`` it has dropped;
    the bytes of the files advised."""
    return _advise(paths, getattr(os, "POSIX_FADV_WILLNEED", 3))


def drop_cached(paths: Iterable[Path]) -> int:
    """Ask the kernel to drop the cached pages of ``paths``, written to disk first (dirty pages
    are not dropped): a cold read next time."""
    return _advise(paths, getattr(os, "POSIX_FADV_DONTNEED", 4), sync=True)


def model_files(directories: Iterable[Path]) -> list[tuple[Path, int]]:
    """Every file under ``directories`` with its size."""
    found = []
    for directory in directories:
        for path in directory.rglob("*"):
            try:
                if path.is_file():
                    found.append((path, path.stat().st_size))
            except OSError:
                continue
    return found
