"""The learned batch limit: starts at the measured limit, drops on OOM, climbs back slowly.

It is touched from the device thread (success, OOM) and read from the event loop (forming batches);
a lock keeps the read-modify-write steps whole.
"""

from __future__ import annotations

import threading


class BatchLimit:
    """Largest batch cost (samples or padded tokens) the batcher may form.

    ``measured`` is the ceiling derived from memory measurement (or ``max_batch_size``); the
    current limit never exceeds it. After an OOM at cost ``c`` the limit halves below ``c`` and
    ``c`` becomes a ceiling that is only lifted after a long run of successes, so a real memory
    wall is not probed over and over while a transient one is eventually forgotten. A ``cap``
    (the largest fixed-shape bucket) bounds ``current`` further without touching what memory
    and OOMs taught.
    """

    def __init__(
        self,
        measured: int,
        *,
        minimum: int = 1,
        recover_after: int = 50,
        forget_after: int = 2000,
    ) -> None:
        if measured < 0:
            raise ValueError(f"measured limit {measured} is negative")
        self._lock = threading.Lock()
        self._measured = measured
        # A measured limit of 0 means one sample cannot fit: every request is refused up front.
        self._floor = minimum
        self._minimum = min(minimum, measured)
        self._current = measured
        self._ceiling = measured
        self._recover_after = recover_after
        self._forget_after = forget_after
        self._successes = 0
        self._since_oom = 0
        self._reported = measured
        self._cap: int | None = None

    @property
    def current(self) -> int:
        return self._current if self._cap is None else min(self._current, self._cap)

    @property
    def cap(self) -> int | None:
        return self._cap

    def set_cap(self, cap: int | None) -> None:
        """Cap batches below the memory limit (no batch worth forming is bigger); None lifts
        the cap."""
        if cap is not None and cap < 1:
            raise ValueError(f"batch cap {cap} must be at least 1")
        with self._lock:
            self._cap = cap

    def remeasure(self, measured: int) -> None:
        """A new measured limit (memory was planned again as models were loaded or unloaded):
        what earlier OOMs taught about the old share no longer applies."""
        if measured < 0:
            raise ValueError(f"measured limit {measured} is negative")
        with self._lock:
            self._measured = measured
            self._minimum = min(self._floor, measured)
            self._current = measured
            self._ceiling = measured
            self._successes = 0
            self._since_oom = 0

    @property
    def measured(self) -> int:
        return self._measured

    @property
    def ceiling(self) -> int:
        return self._ceiling

    def record_out_of_memory(self, cost: int) -> None:
        with self._lock:
            self._successes = 0
            self._since_oom = 0
            self._ceiling = max(self._minimum, min(self._ceiling, cost - 1))
            self._current = max(self._minimum, min(self._current, cost // 2, self._ceiling))

    def record_success(self, cost: int) -> None:
        del cost
        with self._lock:
            self._successes += 1
            self._since_oom += 1
            if self._since_oom >= self._forget_after and self._ceiling < self._measured:
                self._ceiling = self._measured
            if self._successes >= self._recover_after and self._current < self._ceiling:
                step = max(1, self._current // 4)
                self._current = min(self._ceiling, self._current + step)
                self._successes = 0

    def changed(self) -> bool:
        """True once per change of ``current``, so observers export only real changes."""
        with self._lock:
            current = self.current
            if current == self._reported:
                return False
            self._reported = current
            return True
