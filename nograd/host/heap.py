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
import time
from collections.abc import Callable, MutableMapping
from typing import Final

_Trim = Callable[[int], int]
_M_ARENA_MAX: Final = -8
"""glibc's ``mallopt`` parameter for the most arenas threads may allocate from."""
ARENA_VARIABLE: Final = "MALLOC_ARENA_MAX"
"""The same limit as glibc reads it from the environment at a process's start."""
LONG_RUN_S: Final = 0.001
"""A run at least this long hands the heap back as it ends (``AfterRuns``): what it allocated
is worth a trim that costs a small part of it."""
RUNS_INTERVAL_S: Final = 1.0
"""Shorter runs hand it back at most this often."""


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


class AfterRuns:
    """When the runs of one engine hand the heap's free memory back: after a long run, whose
    freed regions would otherwise stay resident for the next one to miss, and after shorter
    runs at most once an interval. A trim after every run re-faults every page of the next: it
    cost as much as a small batch's whole run again, and each arena's lock, which it holds,
    stalled the event loop's allocations meanwhile; what a short run leaves is small."""

    def __init__(
        self,
        long_run_s: float = LONG_RUN_S,
        interval_s: float = RUNS_INTERVAL_S,
        release: Callable[[], bool] = release_free_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._long_run_s = long_run_s
        self._interval_s = interval_s
        self._release = release
        self._clock = clock
        self._last = clock()

    def ran(self, seconds: float) -> bool:
        """A run of ``seconds`` ended; whether the heap was handed back after it."""
        now = self._clock()
        if seconds < self._long_run_s and now - self._last < self._interval_s:
            return False
        self._last = now
        self._release()
        return True
