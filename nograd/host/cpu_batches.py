"""CPU cores shared by the batches one process runs at once on its CPU device threads.

An engine process holds each model once, so two CPU batches at a time run in one process, each
on its own device thread, where worker processes each ran one (``nograd.host.ledger``). torch's
intra-op width is per thread once a thread has run a parallel region, so each batch runs at the
width granted here: a lone batch every core (the low-load case), batches under load an equal
share each. Under load a batch that had to wait for a core takes no more than an equal share,
even when the batch it waited for has just ended: that one's successor is a moment from
arriving, and a batch that took every core would make it wait in turn, so the batches would run
one after another at full width instead of side by side (narrower forwards waste less at each
barrier, and one batch's Python work overlaps the other's kernels).

This module imports no torch.
"""

from __future__ import annotations

import threading
from typing import Final

AUTO_CPU_BATCHES: Final = 2
"""``cpu_batches = auto`` runs at most this many at once, as ``workers = auto`` starts at most two
workers: each batch in flight also takes its share of the activation budget."""


def planned_cpu_batches(
    setting: int | str, beside_fronts: bool, cores_shared: bool, cores: int
) -> int:
    """CPU batches a process runs at once: ``setting`` when a number; for ``auto``, up to
    ``AUTO_CPU_BATCHES`` in an engine process beside fronts whose ``cores`` are shared batch by
    batch, else one."""
    if isinstance(setting, int):
        return setting
    if not (beside_fronts and cores_shared):
        return 1
    return max(1, min(cores, AUTO_CPU_BATCHES))


class BatchCores:
    """Threads for each CPU batch of one process; used from its CPU device threads."""

    def __init__(self, cores: int, batches: int) -> None:
        self.cores = max(1, cores)
        self.batches = max(1, batches)
        """Batches that may run at once: a batch that waited takes no more than its share."""
        self._changed = threading.Condition()
        self._held = 0
        self._running = 0
        self._waiting = 0
        self._local = threading.local()

    def acquire(self, most: int | None = None) -> int:
        """Wait until a core is free; the threads this batch may use (at most ``most``)."""
        with self._changed:
            waited = False
            while self._held >= self.cores:
                waited = True
                self._waiting += 1
                try:
                    self._changed.wait()
                finally:
                    self._waiting -= 1
            others = self._running + self._waiting
            fair = -(-self.cores // (1 + others))  # rounded up, as the workers' ledger does
            if waited:
                fair = min(fair, max(1, self.cores // self.batches))
            take = max(1, min(self.cores - self._held, fair, most or self.cores))
            self._held += take
            self._running += 1
            self._local.take = take
            return take

    def release(self) -> None:
        """The calling thread's batch ended: its cores are free."""
        with self._changed:
            self._held -= self._local.take
            self._running -= 1
            self._local.take = 0
            self._changed.notify()

    def held(self) -> int:
        """Threads the running batches hold now; the tests read it."""
        with self._changed:
            return self._held
