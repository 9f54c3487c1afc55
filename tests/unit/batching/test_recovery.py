"""Every request gets its own outcome: bisection on errors, halving on out-of-memory."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from nograd.batching import (
    SampleTooLarge,
)
from tests.unit.batching.conftest import CountingObserver, FakeRunner, Poison, Rows, make


async def test_a_failing_sample_fails_only_its_own_request(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner(poison=13)
    runner.gate = threading.Event()
    observer = CountingObserver()
    batcher = make(runner, executor, limit=64, observer=observer)
    await batcher.start()
    blocker = asyncio.create_task(batcher.submit(Rows((100,))))
    await asyncio.sleep(0.05)
    tasks = [asyncio.create_task(batcher.submit(Rows((i,)))) for i in range(20)]
    await asyncio.sleep(0.05)
    runner.gate.set()
    results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
    for i, result in enumerate(results[1:]):
        if i == 13:
            assert isinstance(result, Poison)
        else:
            assert result == (i * 2,)
    assert observer.splits > 0
    # The batcher is still alive and serving.
    assert await batcher.submit(Rows((7,))) == (14,)
    assert batcher.alive
    await batcher.stop()


async def test_out_of_memory_splits_and_every_request_is_answered(
    executor: ThreadPoolExecutor,
) -> None:
    k = 6
    runner = FakeRunner(oom_above=k, delay_s=0.001)
    observer = CountingObserver()
    batcher = make(runner, executor, limit=32, observer=observer)
    await batcher.start()
    parts = [Rows(tuple(range(i, i + 1 + i % 3))) for i in range(60)]
    results = await asyncio.gather(*(batcher.submit(p) for p in parts))
    for part, result in zip(parts, results, strict=True):
        assert result == tuple(v * 2 for v in part.values)
    assert batcher.limit.current <= k
    assert observer.ooms > 0 and observer.splits > 0
    assert runner.released == observer.ooms
    assert max(runner.completed) <= k
    await batcher.stop()


async def test_a_sample_too_large_alone_fails_with_sample_too_large(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner(oom_above=4, unit_tokens=True)
    batcher = make(runner, executor, limit=64, unit_tokens=True)
    await batcher.start()
    big = asyncio.create_task(batcher.submit(Rows((1,), length=5)))
    small = [asyncio.create_task(batcher.submit(Rows((i,), length=2))) for i in range(5)]
    with pytest.raises(SampleTooLarge):
        await big
    assert [await t for t in small] == [(i * 2,) for i in range(5)]
    await batcher.stop()


async def test_a_crashing_runner_fails_its_batch_and_the_loop_lives_on(
    executor: ThreadPoolExecutor,
) -> None:
    class Broken(FakeRunner):
        def run_batch(self, parts: Sequence[Rows]) -> list[tuple[int, ...]]:
            if any(0 in p.values for p in parts):
                return []  # wrong number of results: a model bug
            return super().run_batch(parts)

    batcher = make(Broken(), executor)
    await batcher.start()
    with pytest.raises(RuntimeError, match="returned 0 results"):
        await batcher.submit(Rows((0,)))
    assert await batcher.submit(Rows((3,))) == (6,)
    await batcher.stop()
