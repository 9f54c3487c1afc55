"""A model whose device runs several batches at once (a CPU's threads in an engine process):
its next batch leaves for a free thread at once when its batches are long, fills behind the
running one when they are short, and a model that runs one batch at a time never has two."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from nograd.batching import Batcher, BatchLimit
from nograd.batching.batcher import SIDE_BY_SIDE_S
from tests.unit.batching.conftest import FakeRunner, Rows


class OverlapRunner(FakeRunner):
    """Counts the batches running at the same time."""

    def __init__(self, *, delay_s: float) -> None:
        super().__init__(delay_s=delay_s)
        self.running = 0
        self.most = 0
        self._count = threading.Lock()

    def run_batch(self, parts):  # type: ignore[no-untyped-def]
        with self._count:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return super().run_batch(parts)
        finally:
            with self._count:
                self.running -= 1


@pytest.fixture
def two_threads() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


def batcher_of(
    runner: FakeRunner, pool: ThreadPoolExecutor, running: int, staged: int, limit: int = 64
) -> Batcher[Rows, tuple[int, ...]]:
    return Batcher(
        "fake",
        runner,
        pool,
        BatchLimit(limit, recover_after=10_000),
        max_queue_delay_s=5.0,  # a batch fills behind the device for up to 5 s
        max_queue_size=1000,
        max_running_batches=running,
        max_staged_batches=staged,
    )


async def _second_behind_a_held_first(
    batcher: Batcher[Rows, tuple[int, ...]], runner: FakeRunner, measured_s: float
) -> tuple[asyncio.Task[tuple[int, ...]], asyncio.Task[tuple[int, ...]]]:
    """After one measured batch of ``measured_s``, request 1 runs, held on the gate, and
    request 2 arrives behind it."""
    await batcher.start()
    runner.delay_s = measured_s
    await batcher.submit(Rows((0,)))
    runner.delay_s = 0.0
    runner.gate = threading.Event()
    first = asyncio.create_task(batcher.submit(Rows((1,))))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(batcher.submit(Rows((2,))))
    await asyncio.sleep(0.1)
    return first, second


async def test_a_long_batch_does_not_hold_back_the_next_from_a_free_thread(
    two_threads: ThreadPoolExecutor,
) -> None:
    runner = OverlapRunner(delay_s=0.0)
    batcher = batcher_of(runner, two_threads, running=2, staged=1)
    assert batcher.max_running_batches == 2
    first, second = await _second_behind_a_held_first(batcher, runner, 2 * SIDE_BY_SIDE_S)
    # Not filled behind the held batch for 5 s: it runs on the other thread now.
    assert len(runner.batches) == 3
    assert runner.most == 2
    assert runner.gate is not None
    runner.gate.set()
    assert list(await asyncio.gather(first, second)) == [(2,), (4,)]
    await batcher.stop()


async def test_a_short_batch_fills_behind_the_running_one(
    two_threads: ThreadPoolExecutor,
) -> None:
    runner = OverlapRunner(delay_s=0.0)
    batcher = batcher_of(runner, two_threads, running=2, staged=1)
    first, second = await _second_behind_a_held_first(batcher, runner, SIDE_BY_SIDE_S / 10)
    # A forward this short gains less from a thread of its own than a batch costs.
    assert len(runner.batches) == 2
    assert runner.gate is not None
    runner.gate.set()
    assert list(await asyncio.gather(first, second)) == [(2,), (4,)]
    await batcher.stop()


async def test_a_model_that_runs_one_batch_at_a_time_never_runs_two(
    two_threads: ThreadPoolExecutor,
) -> None:
    """Its own code, or sequences whose order counts: none staged, which the free thread
    would start beside the running one."""
    runner = OverlapRunner(delay_s=0.005)
    batcher = batcher_of(runner, two_threads, running=1, staged=0, limit=4)
    await batcher.start()
    results = await asyncio.gather(*(batcher.submit(Rows((i,))) for i in range(40)))
    assert results == [(2 * i,) for i in range(40)]
    assert runner.most == 1
    assert batcher.max_staged_batches == 0
    await batcher.stop()


async def test_side_by_side_batches_answer_every_caller_with_its_own_rows(
    two_threads: ThreadPoolExecutor,
) -> None:
    runner = OverlapRunner(delay_s=2 * SIDE_BY_SIDE_S)
    batcher = batcher_of(runner, two_threads, running=2, staged=1, limit=4)
    await batcher.start()
    parts = [Rows(tuple(range(i, i + 1 + i % 3))) for i in range(60)]
    results = []
    for wave in range(3):  # the first wave measures the model, the later ones overlap
        chunk = parts[wave * 20 : wave * 20 + 20]
        results += await asyncio.gather(*(batcher.submit(p) for p in chunk))
    for part, result in zip(parts, results, strict=True):
        assert result == tuple(v * 2 for v in part.values)
    assert runner.most == 2
    await batcher.stop()


async def test_the_expected_wait_is_shared_among_the_batches_running_at_once(
    two_threads: ThreadPoolExecutor,
) -> None:
    """Queued work behind two threads is expected to take half as long as behind one: shedding
    (``check_wait``) must not refuse what the second thread will run."""
    waits = []
    for running in (1, 2):
        runner = OverlapRunner(delay_s=0.0)
        batcher = batcher_of(runner, two_threads, running=running, staged=1, limit=2)
        first, second = await _second_behind_a_held_first(batcher, runner, 4 * SIDE_BY_SIDE_S)
        queued = [asyncio.create_task(batcher.submit(Rows((i,)))) for i in range(3, 9)]
        await asyncio.sleep(0.01)
        waits.append(batcher.expected_wait_s())
        assert runner.gate is not None
        runner.gate.set()
        await asyncio.gather(first, second, *queued)
        await batcher.stop()
    assert 0 < waits[1] < 0.75 * waits[0]


async def test_batches_side_by_side_take_even_shares_of_the_work(
    two_threads: ThreadPoolExecutor,
) -> None:
    """Eight requests at once become two batches of four, not one of eight beside nothing (or
    one of one beside seven): batches side by side end about together."""
    runner = OverlapRunner(delay_s=2 * SIDE_BY_SIDE_S)
    batcher = batcher_of(runner, two_threads, running=2, staged=1)
    await batcher.start()
    await batcher.submit(Rows((0,)))  # measured: long enough to run side by side
    runner.gate = threading.Event()
    waiting = [asyncio.create_task(batcher.submit(Rows((i,)))) for i in range(1, 9)]
    await asyncio.sleep(0.05)
    runner.gate.set()
    assert list(await asyncio.gather(*waiting)) == [(2 * i,) for i in range(1, 9)]
    assert [sum(p.rows for p in b) for b in runner.batches] == [1, 4, 4]
    await batcher.stop()
