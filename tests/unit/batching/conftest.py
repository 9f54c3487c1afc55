"""The batcher's test doubles: parts of plain rows, a fake runner, a counting observer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from nograd.batching import (
    Batcher,
    BatchLimit,
    NullObserver,
)


@dataclass(frozen=True)
class Rows:
    values: tuple[int, ...]
    length: int = 1

    @property
    def rows(self) -> int:
        return len(self.values)

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.values[start:stop], self.length)


class FakeOOM(Exception):
    pass


class Poison(ValueError):
    pass


class FakeRunner:
    """Doubles every value; can be slowed, poisoned, or made to 'run out of memory' above a cost."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        oom_above: int | None = None,
        poison: int | None = None,
        unit_tokens: bool = False,
    ) -> None:
        self.delay_s = delay_s
        self.oom_above = oom_above
        self.poison = poison
        self.unit_tokens = unit_tokens
        self.batches: list[list[Rows]] = []
        self.completed: list[int] = []
        self.released = 0
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def run_batch(self, parts: Sequence[Rows]) -> list[tuple[int, ...]]:
        with self._lock:
            self.batches.append(list(parts))
        if self.gate is not None:
            self.gate.wait(5)
        if self.delay_s:
            time.sleep(self.delay_s)
        rows = sum(p.rows for p in parts)
        cost = rows * max(p.length for p in parts) if self.unit_tokens else rows
        if self.oom_above is not None and cost > self.oom_above:
            raise FakeOOM(f"cost {cost} > {self.oom_above}")
        if self.poison is not None and any(self.poison in p.values for p in parts):
            raise Poison(f"value {self.poison} breaks the model")
        with self._lock:
            self.completed.append(cost)
        return [tuple(v * 2 for v in p.values) for p in parts]

    def concat(self, results: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        return tuple(v for r in results for v in r)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, FakeOOM)

    def release_memory(self) -> None:
        self.released += 1


class CountingObserver(NullObserver):
    def __init__(self) -> None:
        self.ooms = 0
        self.splits = 0
        self.limits: list[int] = []
        self.dropped_reasons: list[str] = []
        self.batch_rows: list[int] = []

    def batch_started(self, rows: int, cost: int, queue_waits: Sequence[float]) -> None:
        self.batch_rows.append(rows)

    def out_of_memory(self, cost: int) -> None:
        self.ooms += 1

    def split(self) -> None:
        self.splits += 1

    def limit_changed(self, limit: int) -> None:
        self.limits.append(limit)

    def dropped(self, reason: str) -> None:
        self.dropped_reasons.append(reason)


@pytest.fixture
def executor() -> ThreadPoolExecutor:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


def make(
    runner: FakeRunner,
    executor: ThreadPoolExecutor,
    *,
    limit: int = 8,
    delay_s: float = 0.0,
    queue_size: int = 1000,
    unit_tokens: bool = False,
    observer: CountingObserver | None = None,
    max_loop_batch_s: float = 0.0,
) -> Batcher[Rows, tuple[int, ...]]:
    """A batcher of ``runner``; with ``max_loop_batch_s``, the same runner on the event loop."""
    return Batcher(
        "fake",
        runner,
        executor,
        BatchLimit(limit, recover_after=10_000),
        max_queue_delay_s=delay_s,
        max_queue_size=queue_size,
        unit_tokens=unit_tokens,
        observer=observer,
        loop_runner=runner if max_loop_batch_s else None,
        max_loop_batch_s=max_loop_batch_s,
    )
