"""A batch as the thread that runs it sees it: a device thread, or the event loop's own for a short
CPU batch. The last chance to skip callers who left, the run with one outcome per request, and
the batch's time learned."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Generic

from nograd.batching.errors import DeadlineExceeded
from nograd.batching.protocols import BatchObserver, P, R, cost_of
from nograd.batching.recovery import Recovery
from nograd.batching.timing import BatchTiming

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Item(Generic[P, R]):
    """One queued part and the future its caller waits on."""

    part: P
    future: asyncio.Future[R]
    enqueued: float
    deadline: float | None
    cost: int = 0


def execute(
    batch: list[Item[P, R]],
    recovery: Recovery[P, R],
    timing: BatchTiming,
    observer: BatchObserver,
) -> tuple[list[Item[P, R]], list[R | BaseException]]:
    """Each item run or skipped, with its outcome: callers who left are skipped, those whose
    deadline passed fail, the others' parts run as one batch through ``recovery``."""
    start = time.monotonic()
    name = recovery.name
    # Reading done() from a device thread is a benign race: at worst a caller who leaves right
    # now is computed for and its result discarded.
    live: list[Item[P, R]] = []
    expired: list[Item[P, R]] = []
    for item in batch:
        if item.future.done():
            observer.dropped("cancelled")
        elif item.deadline is not None and start > item.deadline:
            observer.dropped("deadline")
            expired.append(item)
        else:
            live.append(item)
    late: list[R | BaseException] = [
        DeadlineExceeded(f"deadline passed while queued for {name!r}") for _ in expired
    ]
    if not live:
        return expired, late
    parts = [item.part for item in live]
    rows = sum(p.rows for p in parts)
    cost = cost_of(parts, recovery.unit_tokens)
    observer.batch_started(rows, cost, [start - it.enqueued for it in live])
    outcomes: list[R | BaseException] = []
    try:
        outcomes = recovery.run(parts)
    finally:
        ok = bool(outcomes) and not any(isinstance(o, BaseException) for o in outcomes)
        seconds = time.monotonic() - start
        if ok:
            timing.observe(cost, seconds)
        observer.batch_finished(rows, seconds, ok)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "batch of %d rows (cost %d) for %s in %.2f ms",
                rows,
                cost,
                name,
                seconds * 1000,
                extra={"model": name, "rows": rows, "ok": ok, "limit": recovery.limit.current},
            )
    return live + expired, outcomes + late
