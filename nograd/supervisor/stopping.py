"""How the stop signals a nograd process receives become one stop.

One stop often arrives as several signals: ``kill -- -PGID`` and systemd's default
``KillMode=control-group`` signal every process of the group, make passes its own SIGTERM on to its
child, and a terminal's Ctrl+C reaches every process at once. Read as "stop, then stop now", those
copies cut every request in flight. So the first SIGTERM or SIGINT starts a drain, every SIGTERM
after it is the same stop, and only an interrupt (Ctrl+C) that comes once the first has been
acknowledged (logged, and more than ``REPEAT_WINDOW_S`` later) means "exit now".

With several workers only the supervisor listens to SIGTERM and SIGINT; it tells each worker to
drain with ``DRAIN_SIGNAL`` and kills them when forced, so a signal to the whole group drains once.
"""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable

REPEAT_WINDOW_S = 1.0
"""Copies of one stop (a group-wide signal, make passing it on) arrive within milliseconds."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DRAIN_SIGNAL = signal.SIGUSR1
"""The supervisor's word to a worker: drain the accepted requests, then exit."""


class Verdict(enum.Enum):
    DRAIN = "drain"
    """The first stop signal: refuse new work, finish what was accepted, exit."""
    SAME = "same"
    """Another copy of a stop already under way: nothing changes."""
    FORCE = "force"
    """An interrupt after the stop was acknowledged: exit now, cutting what is in flight."""


class StopSignals:
    """Counts the stop signals of one process and says what each one means."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._first_at: float | None = None

    @property
    def stopping(self) -> bool:
        return self._first_at is not None

    def receive(self, sig: int) -> Verdict:
        now = self._clock()
        if self._first_at is None:
            self._first_at = now
            return Verdict.DRAIN
        if sig == signal.SIGINT and now - self._first_at >= self._window_s:
            return Verdict.FORCE
        return Verdict.SAME


def describe(sig: int, verdict: Verdict) -> str:
    """The log line for a stop signal, so an operator sees why the process does what it does."""
    name = signal.Signals(sig).name
    if verdict is Verdict.DRAIN:
        return f"{name}: draining (press Ctrl+C again to exit without waiting)"
    if verdict is Verdict.FORCE:
        return f"{name} again: exiting without waiting"
    return f"{name} again: already draining (only a later Ctrl+C exits without waiting)"
