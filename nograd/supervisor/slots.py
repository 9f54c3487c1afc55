"""A worker's place in the supervisor: its process, its channel, and when it starts again."""

from __future__ import annotations

import ctypes
import socket
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event

RESTART_DELAY_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A worker that served this long before dying is restarted at once."""


@dataclass
class Slot:
    index: int
    process: SpawnProcess | None = None
    ready: Event | None = None
    channel: socket.socket | None = None
    """The supervisor's end of the worker's Handoff channel."""
    closed: ctypes.c_longlong | None = None
    sent: int = 0
    """Connections handed to this worker; with ``closed``, the ones it has open."""
    serving: bool = False
    """Warm and handed connections."""
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    resident: int | None = None
    """Resident memory (bytes) when the worker last became ready; None if unreadable."""
    quiet: bool = False
    """Draining, it said it holds no request (``QUIET``)."""


def next_restart(lived_s: float, failures: int) -> tuple[int, float]:
    """(failures so far, delay before the next start) for a worker that died after ``lived_s``.

    A worker that served a while restarts at once; one that keeps dying soon after it starts
    (a bad model, a broken device) waits 1, 2, 4 … up to 30 s, so it cannot spin a core.
    """
    if lived_s >= STABLE_AFTER_S:
        return 0, 0.0
    failures += 1
    return failures, min(RESTART_DELAY_MAX_S, 2.0 ** (failures - 1))
