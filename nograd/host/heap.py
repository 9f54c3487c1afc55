"""Hand the C heap's free memory back to the operating system.

glibc's malloc keeps what a process frees for its next allocations: memory freed in the middle
of a heap, and in the arenas of other threads (the tokenizer's, the thread pool's), stays
resident until the process exits. After a request far larger than usual that is the request's
whole peak, kept for good; ``malloc_trim(0)`` walks every arena and returns each free page.
Elsewhere (musl, macOS) there is no such call and nothing to do.

This module imports no torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

_Trim = Callable[[int], int]


@functools.cache
def _malloc_trim() -> _Trim | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    found: _Trim = trim
    return found


def can_release() -> bool:
    """Whether this process's C library can hand free heap memory back."""
    return _malloc_trim() is not None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True when the C library has a way to (glibc).

    It holds each arena's lock while it walks that arena, so other threads' allocations wait
    for it: call it off the event loop, and not after every request.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
