"""CPU cores shared by the batches one process runs at once on its CPU device threads.

An engine process holds each model once, so two CPU batches at a time run in one process, each
on its own device thread, where worker processes each ran one (``nograd.host.ledger``). torch's
intra-op width is per thread once a thread has run a parallel region, so each batch runs at the
width granted here, by the workers' rules: a lone batch every core (the low-load case), batches
under load an equal share each, never more threads than cores. A device thread whose batch
ended less than ``BUSY_HOLD_S`` ago counts as busy, as a worker with requests in flight does:
under load its next batch is a moment from arriving, and a batch that took every core meanwhile
would make it wait a whole batch, so the batches would run one after another at full width
instead of side by side (narrower forwards waste less at each barrier, and one batch's Python
work overlaps the other's kernels). At one request at a time consecutive batches run on one
thread (``nograd.runtime.executor``), which never holds itself back.

This module imports no torch.
"""

from __future__ import annotations

import threading
import time
from typing import Final

from nograd.host.ledger import BUSY_HOLD_S

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

    def __init__(self, cores: int) -> None:
        self.cores = max(1, cores)
        self._changed = threading.Condition()
        self._holding: dict[int, int] = {}
        """Per device thread running a batch, the threads it holds."""
        self._ended: dict[int, float] = {}
        """Per device thread, when its last batch ended (``time.monotonic``)."""
        self._waiting = 0

    def acquire(self, most: int | None = None) -> int:
        """Wait until a core is free; the threads this batch may use (at most ``most``)."""
        me = threading.get_ident()
        with self._changed:
            held = sum(self._holding.values())
            while held >= self.cores:
                self._waiting += 1
                try:
                    self._changed.wait()
                finally:
                    self._waiting -= 1
                held = sum(self._holding.values())
            # Threads whose batch just ended will want a core again soon: under load the next
            # batch is a moment from arriving.
            recent = time.monotonic() - BUSY_HOLD_S
            resting = sum(
                1
                for thread, ended in self._ended.items()
                if thread != me and thread not in self._holding and ended > recent
            )
            others = len(self._holding) + self._waiting + resting
            fair = -(-self.cores // (1 + others))  # rounded up, as the workers' ledger does
            free = self.cores - held - self._waiting - resting
            take = max(1, min(free, fair, most or self.cores))
            self._holding[me] = take
            return take

    def release(self) -> None:
        """The calling thread's batch ended: its cores are free."""
        me = threading.get_ident()
        with self._changed:
            del self._holding[me]
            self._ended[me] = time.monotonic()
            self._changed.notify_all()  # each waiter takes what is left for it

    def held(self) -> int:
        """Threads the running batches hold now; the tests read it."""
        with self._changed:
            return sum(self._holding.values())
