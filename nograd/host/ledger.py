"""CPU cores shared by the worker processes of one server, batch by batch.

With several workers on a CPU, a fixed share of the cores each (cores / workers intra-op
threads) wastes them whenever the other workers are idle: at concurrency 1 a forward runs on one
thread with the other core idle. Every worker taking every core is worse under load: two OpenMP
teams on the same cores wait at each barrier for a thread the kernel has descheduled.

Nor are cores free just because no other batch runs: a worker answering requests keeps its
event loop busy between batches, and a batch that spread over that loop's core was slowed at
every barrier (docs/architecture.md has the measurements).

So the workers keep a ledger in a small shared file: for each worker the threads its running
batch uses, a flag while it waits for a core, and a flag while it has requests in flight. Before
a batch, a worker takes the cores no other worker's batch holds, less one for each other worker
that holds none but has requests in flight or waits, and no more than its fair share (cores
divided among it and the other workers holding cores or busy, rounded up); with none free it
waits for one.
The threads of running batches never add up to more than the cores, a lone busy worker (the
low-load case) runs at full width, and under load every worker runs at its share. A worker
counts as busy for ``BUSY_HOLD_S`` after its last request left: under load a worker's requests
all leave together after each batch, and the gap before the next ones must not hand its core to
another worker's batch. A worker that dies holding cores is cleared by the supervisor; one that
dies inside the (file-locked) decision releases the lock with its file.

This module imports no torch: the supervisor creates the ledger.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

CELL: Final = 8
"""Bytes per slot value: int64, written whole by aligned stores."""
POLL_S: Final = 0.0002
"""How often a waiting worker looks again. A wait lasts until another worker's batch ends (a
millisecond for digits, tens for minilm), so a finer poll would only burn the core it waits for."""
BUSY_HOLD_S: Final = 0.1
"""A worker stays busy this long after its last request left (see the module's docstring)."""
FIELDS: Final = 3
"""Per worker: threads held, waiting for a core (0/1), and busy until (``time.monotonic_ns``,
the same clock in every process; 0 when idle); one row per field."""
ALWAYS: Final = 2**62
"""Busy-until while requests are in flight."""


@dataclass(frozen=True)
class CoreShare:
    """A worker's place in the ledger; picklable, handed over when the worker is spawned."""

    path: Path
    index: int


def create_ledger(path: Path, workers: int) -> None:
    """A zeroed ledger: a row of ``workers`` cells for each field."""
    path.write_bytes(bytes(FIELDS * workers * CELL))


def clear_slot(path: Path, index: int) -> None:
    """Free what a dead worker held, so the others do not wait for it forever."""
    with contextlib.suppress(OSError), CoreLedger(CoreShare(path, index), cores=1):
        pass  # joining a slot clears it


class CoreLedger:
    """One worker's view of the shared ledger; used from its CPU device thread only."""

    def __init__(self, share: CoreShare, cores: int) -> None:
        self._fd = os.open(share.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        except BaseException:
            os.close(self._fd)
            raise
        self._cells = memoryview(self._map).cast("q")
        self._slots = len(self._cells) // FIELDS
        if not 0 <= share.index < self._slots:
            self.close()
            raise ValueError(f"slot {share.index} is outside the ledger's {self._slots} slots")
        self._me = share.index
        self.cores = max(1, cores)
        self.clear()

    def __enter__(self) -> CoreLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._cells.release()
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def clear(self) -> None:
        with self._locked():
            for field in range(FIELDS):
                self._cells[field * self._slots + self._me] = 0

    def set_active(self, active: bool) -> None:
        """Whether this worker has requests in flight (its event loop wants a core)."""
        until = ALWAYS if active else time.monotonic_ns() + int(BUSY_HOLD_S * 1e9)
        self._cells[2 * self._slots + self._me] = until

    def try_acquire(self, most: int | None = None) -> int:
        """Threads to run the next batch with (at most ``most``), now; 0 when every core is
        held by others."""
        cells, slots, me = self._cells, self._slots, self._me
        now = time.monotonic_ns()
        with self._locked():
            held = 0
            reserve = 0
            others = 0
            for other in range(slots):
                if other == me:
                    continue
                held += cells[other]
                wants = bool(cells[slots + other]) or cells[2 * slots + other] > now
                if cells[other] or wants:
                    others += 1
                if cells[other] == 0 and wants:
                    reserve += 1  # busy or waiting without a core: it will want one soon
            free = self.cores - held
            if free < 1:
                cells[slots + me] = 1
                return 0
            fair = -(-self.cores // (1 + others))  # with others busy, no more than a fair share
            take = max(1, min(free - reserve, fair, most or self.cores))
            cells[me] = take
            cells[slots + me] = 0
            return take

    def acquire(self, most: int | None = None) -> int:
        """Wait until a core is free; the threads this worker's batch may use."""
        while True:
            take = self.try_acquire(most)
            if take:
                return take
            time.sleep(POLL_S)

    def release(self) -> None:
        # One aligned store of this worker's own cell: no lock needed.
        self._cells[self._me] = 0

    def held(self) -> list[int]:
        """Threads each worker holds now; the tests read it to check every state's exact split."""
        return [self._cells[i] for i in range(self._slots)]
