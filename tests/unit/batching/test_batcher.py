"""Batch formation driven directly: no HTTP, no torch; a fake runner records every batch."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nograd.batching import (
    Batcher,
    BatchLimit,
    DeadlineExceeded,
    QueueFull,
    SampleTooLarge,
)
from tests.unit.batching.conftest import CountingObserver, FakeRunner, Rows, make


async def test_each_caller_gets_its_own_rows_back(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner(delay_s=0.005)
    batcher = make(runner, executor, limit=16)
    await batcher.start()
    parts = [Rows(tuple(range(i * 10, i * 10 + (i % 3) + 1))) for i in range(40)]
    results = await asyncio.gather(*(batcher.submit(p) for p in parts))
    for part, result in zip(parts, results, strict=True):
        assert result == tuple(v * 2 for v in part.values)
    assert len(runner.batches) < len(parts), "concurrent requests were not combined"
    await batcher.stop()


async def test_no_batch_exceeds_the_limit(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner(delay_s=0.002)
    batcher = make(runner, executor, limit=5)
    await batcher.start()
    await asyncio.gather(*(batcher.submit(Rows((i, i + 1))) for i in range(50)))
    assert max(sum(p.rows for p in batch) for batch in runner.batches) <= 5
    await batcher.stop()


async def test_idle_model_dispatches_at_once_despite_a_long_delay(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    batcher = make(runner, executor, limit=64, delay_s=2.0)
    await batcher.start()
    started = time.monotonic()
    assert await batcher.submit(Rows((1,))) == (2,)
    assert time.monotonic() - started < 0.5, "a lone request paid the queue delay"
    await batcher.stop()


async def _ten_behind_a_running_batch(
    batcher: Batcher[Rows, tuple[int, ...]], runner: FakeRunner
) -> None:
    """Request 0 runs, held on the runner's gate, while requests 1 to 10 queue behind it."""
    assert runner.gate is not None
    await batcher.start()
    first = asyncio.create_task(batcher.submit(Rows((0,))))
    await asyncio.sleep(0.05)  # the first batch is now blocked on the gate
    later = [asyncio.create_task(batcher.submit(Rows((i,)))) for i in range(1, 11)]
    await asyncio.sleep(0.05)
    runner.gate.set()
    await asyncio.gather(first, *later)


async def test_requests_arriving_during_a_batch_form_the_next_batch(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    batcher = make(runner, executor, limit=64, delay_s=5.0)
    await _ten_behind_a_running_batch(batcher, runner)
    # Ten requests queued behind a running batch go out together as soon as it ends, without
    # waiting for the 5 s delay.
    assert [sum(p.rows for p in b) for b in runner.batches] == [1, 10]
    await batcher.stop()


async def test_busy_model_waits_at_most_the_delay_to_fill(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    batcher = make(runner, executor, limit=64, delay_s=0.05)
    await batcher.start()
    first = asyncio.create_task(batcher.submit(Rows((0,))))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(batcher.submit(Rows((1,))))
    await asyncio.sleep(0.2)
    # The staged batch left for the device after its delay although the first still runs.
    assert len(runner.batches) == 1  # the device thread is still blocked on the first batch
    runner.gate.set()
    await asyncio.gather(first, second)
    assert len(runner.batches) == 2
    await batcher.stop()


async def measured(
    executor: ThreadPoolExecutor, seconds_per_row: float
) -> tuple[FakeRunner, Batcher[Rows, tuple[int, ...]]]:
    """A started batcher (delay 20 ms) that has run one row, taking ``seconds_per_row``."""
    runner = FakeRunner(delay_s=seconds_per_row)
    batcher = make(runner, executor, limit=64, delay_s=0.02)
    await batcher.start()
    await batcher.submit(Rows((0,)))
    return runner, batcher


async def test_a_staged_batch_keeps_filling_until_the_device_is_expected_to_free(
    executor: ThreadPoolExecutor,
) -> None:
    runner, batcher = await measured(executor, 0.2)
    running = asyncio.create_task(batcher.submit(Rows((1,))))  # expected to end in 0.2 s
    staged = []
    for pause in (0.02, 0.06, 0.06):  # at 20, 80 and 140 ms
        await asyncio.sleep(pause)
        staged.append(asyncio.create_task(batcher.submit(Rows((2,)))))
    await asyncio.gather(running, *staged)
    # Cut at its delay (40 ms) the staged batch would have held one request and waited for the
    # device all the same; it took all three, cut 20 ms before the running batch was to end.
    assert [sum(p.rows for p in b) for b in runner.batches] == [1, 1, 3]
    await batcher.stop()


async def test_a_staged_batch_leaves_when_the_device_frees_before_it_was_expected_to(
    executor: ThreadPoolExecutor,
) -> None:
    runner, batcher = await measured(executor, 0.5)
    runner.delay_s = 0.05  # now the model is ten times faster than measured
    started = time.monotonic()
    running = asyncio.create_task(batcher.submit(Rows((1,))))
    await asyncio.sleep(0.01)
    assert await batcher.submit(Rows((2,))) == (4,)
    await running
    # Not held until the expected end (0.48 s): dispatched once the device was free.
    assert time.monotonic() - started < 0.3
    assert [sum(p.rows for p in b) for b in runner.batches] == [1, 1, 1]
    await batcher.stop()


async def test_cancelled_request_is_dropped_before_its_batch(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    observer = CountingObserver()
    batcher = make(runner, executor, limit=64, observer=observer)
    await batcher.start()
    blocker = asyncio.create_task(batcher.submit(Rows((1,))))
    await asyncio.sleep(0.05)
    doomed = asyncio.create_task(batcher.submit(Rows((99,))))
    kept = asyncio.create_task(batcher.submit(Rows((2,))))
    await asyncio.sleep(0.01)
    doomed.cancel()
    runner.gate.set()
    assert await blocker == (2,)
    assert await kept == (4,)
    seen = [v for batch in runner.batches for p in batch for v in p.values]
    assert 99 not in seen
    assert "cancelled" in observer.dropped_reasons
    await batcher.stop()


async def test_request_larger_than_the_limit_is_split_and_reassembled(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    batcher = make(runner, executor, limit=4)
    await batcher.start()
    values = tuple(range(11))
    assert await batcher.submit(Rows(values)) == tuple(v * 2 for v in values)
    assert max(sum(p.rows for p in b) for b in runner.batches) <= 4
    assert len(runner.batches) >= 3
    await batcher.stop()


async def test_sample_longer_than_the_token_limit_is_refused_up_front(
    executor: ThreadPoolExecutor,
) -> None:
    batcher = make(FakeRunner(unit_tokens=True), executor, limit=10, unit_tokens=True)
    await batcher.start()
    with pytest.raises(SampleTooLarge):
        await batcher.submit(Rows((1,), length=11))
    await batcher.stop()


async def test_token_batches_cost_count_times_longest_and_group_by_length(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner(unit_tokens=True)
    runner.gate = threading.Event()
    batcher = make(runner, executor, limit=64, unit_tokens=True)
    await batcher.start()
    blocker = asyncio.create_task(batcher.submit(Rows((0,), length=1)))
    await asyncio.sleep(0.05)
    lengths = [4, 32, 4, 32, 4, 32, 4, 4]
    tasks = [
        asyncio.create_task(batcher.submit(Rows((i,), length=n))) for i, n in enumerate(lengths)
    ]
    await asyncio.sleep(0.05)
    runner.gate.set()
    await asyncio.gather(blocker, *tasks)
    for batch in runner.batches:
        assert sum(p.rows for p in batch) * max(p.length for p in batch) <= 64
    # Short requests ride together instead of being padded to 32 by a long neighbour.
    second = runner.batches[1]
    assert {p.length for p in second} == {4}
    assert sum(p.rows for p in second) == 5
    await batcher.stop()


async def test_long_requests_are_not_starved(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner(unit_tokens=True, delay_s=0.001)
    batcher = make(runner, executor, limit=32, unit_tokens=True)
    await batcher.start()
    long_task = asyncio.create_task(batcher.submit(Rows((999,), length=30)))
    shorts = [asyncio.create_task(batcher.submit(Rows((i,), length=2))) for i in range(200)]
    assert await asyncio.wait_for(long_task, 5) == (1998,)
    await asyncio.gather(*shorts)
    await batcher.stop()


async def test_full_queue_is_refused_at_once(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    batcher = make(runner, executor, limit=1, queue_size=3)
    await batcher.start()
    running = asyncio.create_task(batcher.submit(Rows((0,))))
    await asyncio.sleep(0.05)
    # The first of these is staged behind the running batch; the next three fill the queue.
    queued = []
    for i in range(1, 5):
        queued.append(asyncio.create_task(batcher.submit(Rows((i,)))))
        await asyncio.sleep(0.01)
    assert batcher.queue_depth == 3
    with pytest.raises(QueueFull):
        await batcher.submit(Rows((9,)))
    runner.gate.set()
    await asyncio.gather(running, *queued)
    await batcher.stop()


async def test_expired_deadline_is_dropped_before_compute(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    observer = CountingObserver()
    batcher = make(runner, executor, limit=1, observer=observer)
    await batcher.start()
    running = asyncio.create_task(batcher.submit(Rows((0,))))
    await asyncio.sleep(0.05)
    late = asyncio.create_task(batcher.submit(Rows((5,)), deadline=time.monotonic() + 0.01))
    await asyncio.sleep(0.05)
    runner.gate.set()
    await running
    with pytest.raises(DeadlineExceeded):
        await late
    assert 5 not in [v for b in runner.batches for p in b for v in p.values]
    assert "deadline" in observer.dropped_reasons
    await batcher.stop()


async def test_stop_drains_queued_work(executor: ThreadPoolExecutor) -> None:
    runner = FakeRunner(delay_s=0.01)
    batcher = make(runner, executor, limit=2)
    await batcher.start()
    tasks = [asyncio.create_task(batcher.submit(Rows((i,)))) for i in range(10)]
    await asyncio.sleep(0)
    await batcher.stop(drain_timeout_s=5)
    assert [t.result() for t in tasks] == [(i * 2,) for i in range(10)]


async def test_parts_of_different_groups_never_share_a_batch(
    executor: ThreadPoolExecutor,
) -> None:
    runner = FakeRunner()
    runner.gate = threading.Event()
    batcher: Batcher[Rows, tuple[int, ...]] = Batcher(
        "grouped",
        runner,
        executor,
        BatchLimit(64, recover_after=10_000),
        max_queue_delay_s=5.0,
        max_queue_size=100,
        group_of=lambda part: part.values[0] % 2,
    )
    await _ten_behind_a_running_batch(batcher, runner)
    # Behind the running batch: the oldest (odd) with every odd one, then the even ones.
    groups = [sorted(p.values[0] for p in batch) for batch in runner.batches]
    assert groups == [[0], [1, 3, 5, 7, 9], [2, 4, 6, 8, 10]]
    await batcher.stop()
