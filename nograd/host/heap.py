"""Hand the C heap's free memory back to the operating system, and keep it where it can be.

glibc's malloc keeps what a process frees for its next allocations: memory freed in the middle
of a heap, and in the arenas of other threads (the tokenizer's, the thread pool's), stays
resident until the process exits. After a request far larger than usual that is the request's
whole peak, kept for good; ``malloc_trim(0)`` walks every arena and returns each free page, but
the free memory at the top of another thread's arena it leaves resident, and the next
allocation there reuses it unseen: a batch measured on the device thread then reads as needing
nothing. One arena for every thread (:func:`use_one_arena`) leaves no such memory.
Elsewhere (musl, macOS) there is no such call and nothing to do.

This module imports no torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, MutableMapping
from typing import Final

_Trim = Callable[[int], int]
_M_ARENA_MAX: Final = -8
"""glibc's ``mallopt`` parameter for the most arenas threads may allocate from."""
ARENA_VARIABLE: Final = "MALLOC_ARENA_MAX"
"""The same limit as glibc reads it from the environment at a process's start."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> _Trim | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    found: _Trim = trim
    return found


def use_one_arena(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Every thread created from now on allocates from glibc's main arena, and so do the
    processes this one starts (through ``MALLOC_ARENA_MAX``, unless the operator set it): the
    process's free memory is then all where ``malloc_trim`` hands it back, and what a batch
    allocates shows in the resident set the memory plan measures. Call it before any thread
    allocates; True where the C library has the setting (glibc)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    environ.setdefault(ARENA_VARIABLE, "1")
    if environ[ARENA_VARIABLE] != "1":
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, 1))


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
