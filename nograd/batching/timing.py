"""How long a batch takes, learned from the batches that ran: a fixed part plus a part per unit
of cost, so the queue's expected wait holds at every batch size.

One figure per unit of cost, learned at low load from batches of one short request, counts
their fixed part once per unit: the wait of a queue of large batches comes out several times
too long, and shedding refuses work the device could start in time.
"""

from __future__ import annotations

import math
import threading

from nograd.batching.errors import WaitTooLong

MEMORY = 0.8
"""Weight of the earlier batches after each new one: the fit follows the last ten or so."""

SPREAD = 0.1
"""Below this spread of costs (standard deviation over mean) the batches tell no fixed part."""

OUTLIER = 4.0
"""A batch is learned as at most this many times the fit's estimate. A process paused mid-batch
(SIGSTOP, a stalled host) measures the pause: learned whole, one such batch would refuse every
request for the next ten batches, and none run while everything is refused."""


class BatchTiming:
    """Seconds of a batch as ``fixed + per_cost * cost``, a least-squares fit over recent batches
    weighted towards the latest; the fixed part is 0 until batches of different costs have run.

    ``observe`` runs on the device threads (one at a time, under a lock) and the estimates on
    the event loop: the fit is one tuple and the usual cost one number, each replaced whole, so
    a reader never sees half an update.
    """

    def __init__(self) -> None:
        self._weight = 0.0
        self._cost = 0.0
        self._seconds = 0.0
        self._cost2 = 0.0
        self._cost_seconds = 0.0
        self._fit = (0.0, 0.0)
        """(fixed seconds, seconds per unit of cost)."""
        self._usual_cost = 0
        self._observing = threading.Lock()

    @property
    def known(self) -> bool:
        """False until a batch has been measured: nothing is estimated (or shed) before."""
        return self._fit[1] > 0.0

    @property
    def fit(self) -> tuple[float, float]:
        return self._fit

    def observe(self, cost: int, seconds: float) -> None:
        """Learn from one batch that ran to completion."""
        if cost <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        with self._observing:
            if self.known:
                seconds = min(seconds, OUTLIER * self.batch_s(cost))
            x, y = float(cost), seconds
            self._weight = MEMORY * self._weight + 1.0
            self._cost = MEMORY * self._cost + x
            self._seconds = MEMORY * self._seconds + y
            self._cost2 = MEMORY * self._cost2 + x * x
            self._cost_seconds = MEMORY * self._cost_seconds + x * y
            self._fit = self._solve()
            self._usual_cost = round(self._cost / self._weight)

    def _solve(self) -> tuple[float, float]:
        w = self._weight
        mean_x, mean_y = self._cost / w, self._seconds / w
        variance = max(0.0, self._cost2 / w - mean_x * mean_x)
        proportional = (0.0, self._seconds / self._cost)
        if variance < (SPREAD * mean_x) ** 2:
            return proportional
        slope = (self._cost_seconds / w - mean_x * mean_y) / variance
        fixed = mean_y - slope * mean_x
        if slope <= 0.0 or fixed < 0.0:
            return proportional
        return fixed, slope

    @property
    def usual_cost(self) -> int:
        """The cost of the recent batches, weighted as the fit weighs them (0 before any)."""
        return self._usual_cost

    def batch_s(self, cost: int) -> float:
        """Expected seconds of one batch of ``cost``."""
        fixed, per_cost = self._fit
        return fixed + per_cost * cost if cost > 0 else 0.0

    def queue_s(self, cost: int, limit: int) -> float:
        """Expected seconds to run ``cost`` of queued work in batches of at most ``limit``."""
        if cost <= 0:
            return 0.0
        fixed, per_cost = self._fit
        return fixed * math.ceil(cost / max(limit, 1)) + per_cost * cost


def refuse_long_wait(
    name: str,
    wait: float,
    batch: float,
    now: float,
    deadline: float | None,
    max_wait_s: float | None,
    waited_s: float,
) -> None:
    """Raise ``WaitTooLong`` when a request of model ``name`` queued ``now``, expected to wait
    ``wait`` seconds for its batch to start, would start past its ``deadline``, or be answered
    (its wait and its own ``batch``) later than ``max_wait_s`` after it arrived, ``waited_s``
    ago (reading, decoding, tokenising, a busy event loop). The bound never refuses a request
    whose batch is expected to start after one usual batch."""
    if deadline is not None and wait > deadline - now:
        bound = "the request's deadline"
        over = wait - max(deadline - now, 0.0)
    elif max_wait_s is not None:
        answered = waited_s + wait + batch
        if answered <= max(max_wait_s, waited_s + 2 * batch):
            return
        bound = f"the {max_wait_s:g} s bound (NOGRAD_MAX_QUEUE_WAIT_S)"
        if waited_s >= 0.05:
            bound += f", {waited_s:.2f} s of it spent before the queue"
        over = answered - max_wait_s
    else:
        return
    retry_after = min(60.0, max(1.0, math.ceil(over)))
    raise WaitTooLong(
        f"model {name!r} is overloaded: the work queued ahead is expected to take "
        f"{wait:.2f} s, so the request would be answered past {bound}; retry in "
        f"{retry_after:.0f} s",
        retry_after_s=retry_after,
    )
