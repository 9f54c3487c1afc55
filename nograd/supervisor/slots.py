"""A worker's place in the supervisor: its process, its channel, and when it starts again."""

from __future__ import annotations

import ctypes
import socket
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event

from nograd.settings import Settings
from nograd.supervisor.handoff import GRPC, HTTP, least_loaded, send_connection

RESTART_DELAY_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A worker that served this long before dying is restarted at once."""


@dataclass
class Slot:
    index: int
    serve: str = ""
    """The function its process serves with (``"module:function"``)."""
    takes: frozenset[bytes] = frozenset()
    """The fronts whose connections it is handed (``HTTP``, ``GRPC``)."""
    role: str = "worker"
    """What it is, for the log: a worker, the engine or a front."""
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

    @property
    def name(self) -> str:
        return "engine" if self.role == "engine" else f"{self.role} {self.index}"


def next_restart(lived_s: float, failures: int) -> tuple[int, float]:
    """(failures so far, delay before the next start) for a worker that died after ``lived_s``.

    A worker that served a while restarts at once; one that keeps dying soon after it starts
    (a bad model, a broken device) waits 1, 2, 4 … up to 30 s, so it cannot spin a core.
    """
    if lived_s >= STABLE_AFTER_S:
        return 0, 0.0
    failures += 1
    return failures, min(RESTART_DELAY_MAX_S, 2.0 ** (failures - 1))


def plan_slots(
    settings: Settings, serve: str, front: str | None, ports: frozenset[bytes]
) -> list[Slot]:
    """``settings.workers`` workers serving every port with ``serve``; or, with ``front``, the
    engine (``serve``: every model, the gRPC connections) and ``settings.fronts`` fronts (HTTP)."""
    if front is None:
        return [Slot(i, serve, ports) for i in range(settings.worker_count)]
    return [Slot(0, serve, frozenset({GRPC}), "engine")] + [
        Slot(i, front, frozenset({HTTP}), "front") for i in range(1, settings.front_count + 1)
    ]


def describe_processes(slots: list[Slot]) -> str:
    if slots[0].role != "engine":
        return f"{len(slots)} worker processes"
    return f"one engine process and {len(slots) - 1} front processes"


def open_connections(slot: Slot) -> int | None:
    # A serving slot always has its channel and counter (closing its channel clears all three).
    if not slot.serving or slot.closed is None:
        return None
    return slot.sent - slot.closed.value


def hand_to(slots: list[Slot], conn: socket.socket, front: bytes, last: int) -> int | None:
    """Hand ``conn`` to the serving slot that takes ``front`` with the fewest open connections
    (ties in turn after ``last``); the slot's index, or None when none could take it."""
    tried: set[int] = set()
    while True:
        loads = [
            open_connections(s) if s.index not in tried and front in s.takes else None
            for s in slots
        ]
        index = least_loaded(loads, last)
        if index is None:
            return None
        slot = slots[index]
        assert slot.channel is not None
        try:
            send_connection(slot.channel, conn, front)
        except BlockingIOError:
            tried.add(index)  # its inbox is full: the process is stuck; try another
            continue
        except OSError:
            tried.add(index)  # its end is closed: the process is exiting or gone
            slot.serving = False
            continue
        slot.sent += 1
        return index
