"""Shedding by expected wait: the queue refuses what it cannot start in time, at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nograd.batching import Batcher, DeadlineExceeded, QueueFull, WaitTooLong
from tests.unit.batching.conftest import FakeRunner, Rows, make

BATCH_S = 0.05
"""The fake model's time per batch: 4 rows at the limit, so 12.5 ms per row."""


async def test_nothing_is_shed_before_the_speed_is_known(executor: ThreadPoolExecutor) -> None:
    batcher = make(FakeRunner(delay_s=BATCH_S), executor, limit=4)
    await batcher.start()
    assert batcher.expected_wait_s() == 0.0
    results = await asyncio.gather(
        *(batcher.submit(Rows((i,)), max_wait_s=0.001) for i in range(12))
    )
    assert len(results) == 12
    await batcher.stop()


async def test_a_request_is_refused_when_the_queue_ahead_outlasts_the_bound(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner(delay_s=BATCH_S)
    batcher = make(runner, executor, limit=4)
    await batcher.start()
    await batcher.submit(Rows((1, 2, 3, 4)))
    # 40 rows queued: 10 batches, about 0.5 s of work ahead of the next request.
    accepted = [
        asyncio.ensure_future(batcher.submit(Rows((i,)), max_wait_s=1.0)) for i in range(40)
    ]
    await asyncio.sleep(0)
    assert 0.3 < batcher.expected_wait_s() < 1.0
    started = time.monotonic()
    with pytest.raises(WaitTooLong) as refused:
        await batcher.submit(Rows((99,)), max_wait_s=0.2)
    assert time.monotonic() - started < 0.01  # at once, not after queueing
    assert refused.value.reason == "queue_wait"
    assert 1 <= refused.value.retry_after_s <= 60
    assert "expected to take" in str(refused.value) and "NOGRAD_MAX_QUEUE_WAIT_S" in str(
        refused.value
    )
    assert isinstance(refused.value, QueueFull)  # a 503, as a full queue
    assert len(await asyncio.gather(*accepted)) == 40  # what was accepted is served
    await batcher.stop()


async def test_the_bound_never_refuses_a_wait_of_one_batch(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner(delay_s=BATCH_S)
    batcher = make(runner, executor, limit=4)
    await batcher.start()
    await batcher.submit(Rows((1, 2, 3, 4)))
    running = asyncio.ensure_future(batcher.submit(Rows((1, 2, 3, 4))))
    await asyncio.sleep(0.005)
    # One batch (~50 ms) on the device: a bound of 1 ms still lets the next request queue.
    assert await batcher.submit(Rows((7,)), max_wait_s=0.001) == (14,)
    await running
    await batcher.stop()


async def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner(delay_s=BATCH_S)
    batcher = make(runner, executor, limit=4)
    await batcher.start()
    await batcher.submit(Rows((1, 2, 3, 4)))
    queued = [asyncio.ensure_future(batcher.submit(Rows((i,)))) for i in range(40)]
    await asyncio.sleep(0)
    with pytest.raises(WaitTooLong, match="deadline"):
        await batcher.submit(Rows((99,)), deadline=time.monotonic() + 0.1)
    # A deadline the queue can meet is accepted.
    assert await batcher.submit(Rows((5,)), deadline=time.monotonic() + 5.0) == (10,)
    await asyncio.gather(*queued)
    assert batcher.expected_wait_s() < BATCH_S  # the queue's cost left with its items
    await batcher.stop()


async def test_a_request_whose_deadline_has_passed_is_a_deadline_error_not_a_shed(
    executor: ThreadPoolExecutor,
) -> None:
    batcher = make(FakeRunner(delay_s=BATCH_S), executor, limit=4)
    await batcher.start()
    await batcher.submit(Rows((1, 2, 3, 4)))  # the speed is known
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        await batcher.submit(Rows((1,)), deadline=time.monotonic() - 0.001, max_wait_s=1.0)
    await batcher.stop()


async def two_batches_held(
    runner: FakeRunner, batcher: Batcher[Rows, tuple[int, ...]]
) -> tuple[Batcher[Rows, tuple[int, ...]], list[asyncio.Future[tuple[int, ...]]]]:
    """``batcher`` started, its speed learned from one batch of 4 rows (12.5 ms a row), then two
    more such batches on the device, held there until ``runner.gate`` is set."""
    await batcher.start()
    await batcher.submit(Rows((1, 2, 3, 4)))
    runner.gate = threading.Event()
    held = [asyncio.ensure_future(batcher.submit(Rows((1, 2, 3, 4)))) for _ in range(2)]
    await asyncio.sleep(0.01)
    return batcher, held


async def test_a_limit_far_above_the_batches_run_does_not_lift_the_bound(
    executor: ThreadPoolExecutor,
) -> None:
    # A token model's limit holds thousands of tokens it never batches: one batch at the limit
    # is 12.5 s here, and a floor of one such batch would never refuse.
    runner = FakeRunner(delay_s=BATCH_S)
    batcher, held = await two_batches_held(runner, make(runner, executor, limit=1000))
    queued = [asyncio.ensure_future(batcher.submit(Rows((i,)))) for i in range(40)]
    await asyncio.sleep(0)
    # Two batches on the device and 40 rows queued: about 0.6 s before the next one is answered.
    with pytest.raises(WaitTooLong):
        await batcher.submit(Rows((99,)), max_wait_s=0.2)
    runner.gate.set()
    await asyncio.gather(*held, *queued)
    await batcher.stop()


async def test_the_time_spent_before_the_queue_counts_against_the_bound(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner(delay_s=BATCH_S)
    batcher, held = await two_batches_held(runner, make(runner, executor, limit=4))
    # About 0.1 s on the device, then its own batch: within 0.3 s of a fresh arrival...
    batcher.check_wait(time.monotonic(), None, 0.3, waited_s=0.0)
    # ...but not of one that already waited 0.25 s to get here.
    with pytest.raises(WaitTooLong, match="before the queue"):
        batcher.check_wait(time.monotonic(), None, 0.3, waited_s=0.25)
    runner.gate.set()
    await asyncio.gather(*held)
    await batcher.stop()
