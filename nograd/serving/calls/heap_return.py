"""Memory a request far larger than usual leaves behind, handed back to the OS once it is answered.

Decoding, tokenising and batching a request of many megabytes allocates hundreds of megabytes in
the C heap, across the arenas of several threads; glibc keeps every freed page of them for reuse,
so one such request would raise the process's resident memory for good. After such a request has
been answered (its body and reply freed too), a worker thread calls
:func:`nograd.host.heap.release_free_memory`; at most once per interval, since the call locks
each arena while it walks it. Ordinary requests never trigger it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Final

import numpy as np

from nograd.host.heap import can_release, release_free_memory

logger = logging.getLogger(__name__)

LARGE_REQUEST_BYTES: Final = 1 << 20
"""Input bytes (text, or tensor data) from which a request counts as far larger than usual:
hundreds of sentences, or a thousand rows of a small image model."""

MIN_INTERVAL_S: Final = 1.0
"""Shortest time between two releases; large requests in a row are released together."""


def input_bytes(inputs: Mapping[str, np.ndarray], stop_at: int) -> int:
    """The request's data in bytes (texts by length), counted until ``stop_at`` is reached."""
    total = 0
    for array in inputs.values():
        if array.dtype != np.object_:
            total += array.nbytes
        else:
            for value in array.flat:
                if isinstance(value, (bytes, bytearray, str)):
                    total += len(value)
                if total >= stop_at:
                    break
        if total >= stop_at:
            break
    return total


class HeapReturn:
    """Asked after each request is answered; releases free heap memory when a large one was."""

    def __init__(
        self,
        large_bytes: int = LARGE_REQUEST_BYTES,
        interval_s: float = MIN_INTERVAL_S,
        release: Callable[[], bool] | None = None,
    ) -> None:
        self._large = large_bytes
        self._interval = interval_s
        self._release = release
        if release is None and can_release():
            self._release = release_free_memory
        self._pending = False
        """A large request finished since the last release was started."""
        self._scheduled = False
        self._last = -math.inf
        self.releases = 0
        """Releases run so far."""

    def is_large(self, inputs: Mapping[str, np.ndarray]) -> bool:
        return self._release is not None and input_bytes(inputs, self._large) >= self._large

    def finished_large(self) -> None:
        """A large request has its outputs; its memory is freed once it is answered."""
        self._pending = True

    def answered(self) -> None:
        """A request was answered: schedule a release if a large one finished (on the loop)."""
        if self._pending and not self._scheduled:
            self._schedule()

    def _schedule(self) -> None:
        self._scheduled = True
        delay = max(0.0, self._last + self._interval - time.monotonic())
        asyncio.get_running_loop().call_later(delay, self._start)

    def _start(self) -> None:
        release = self._release
        assert release is not None
        self._pending = False
        try:
            future = asyncio.get_running_loop().run_in_executor(None, self._timed, release)
        except RuntimeError:
            self._scheduled = False  # the loop's executor is shut down: the process is stopping
            return
        future.add_done_callback(self._done)

    @staticmethod
    def _timed(release: Callable[[], bool]) -> float:
        started = time.perf_counter()
        release()
        return time.perf_counter() - started

    def _done(self, future: asyncio.Future[float]) -> None:
        self._scheduled = False
        self._last = time.monotonic()
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            logger.warning("returning free heap memory to the OS failed: %r", error)
        else:
            self.releases += 1
            logger.debug("returned free heap memory to the OS in %.3f s", future.result())
        if self._pending:
            self._schedule()  # a large request finished meanwhile: its memory, a moment later
