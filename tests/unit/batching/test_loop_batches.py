"""A short batch runs on the event loop's own thread: once the model's batches are measured short,
while none of its batches is on the device thread; a long one, an unmeasured one and every batch
of a model without a loop runner go to the device thread. The loop turns between two of them,
and a poison sample still fails alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from nograd.batching import Batcher
from tests.unit.batching.conftest import FakeRunner, Poison, Rows, make


class ThreadRecordingRunner(FakeRunner):
    """Records the thread each batch ran on, in order."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.threads: list[int] = []

    def run_batch(self, parts: Sequence[Rows]) -> list[tuple[int, ...]]:
        self.threads.append(threading.get_ident())
        return super().run_batch(parts)


def batcher_of(
    runner: ThreadRecordingRunner,
    executor: ThreadPoolExecutor,
    max_loop_batch_s: float,
    *,
    on_loop: bool = True,
    limit: int = 8,
) -> Batcher[Rows, tuple[int, ...]]:
    batcher = make(runner, executor, limit=limit, max_loop_batch_s=1.0 if on_loop else 0.0)
    batcher.max_loop_batch_s = max_loop_batch_s
    return batcher


async def test_short_batches_run_on_the_loop_once_measured(executor: ThreadPoolExecutor) -> None:
    runner = ThreadRecordingRunner()
    batcher = batcher_of(runner, executor, 1.0)
    await batcher.start()
    loop_thread = threading.get_ident()
    for value in range(3):
        assert await batcher.submit(Rows((value,))) == (value * 2,)
    await batcher.stop()
    first, *later = runner.threads
    assert first != loop_thread  # unmeasured: the device thread
    assert later == [loop_thread, loop_thread]


@pytest.mark.parametrize(("max_loop_batch_s", "on_loop"), [(0.0, True), (1.0, False)])
async def test_without_a_bound_or_a_loop_runner_every_batch_runs_on_the_device_thread(
    executor: ThreadPoolExecutor, max_loop_batch_s: float, on_loop: bool
) -> None:
    runner = ThreadRecordingRunner()
    batcher = batcher_of(runner, executor, max_loop_batch_s, on_loop=on_loop)
    await batcher.start()
    for value in range(3):
        await batcher.submit(Rows((value,)))
    await batcher.stop()
    assert threading.get_ident() not in runner.threads
    assert len(runner.threads) == 3


async def test_a_batch_expected_to_take_longer_runs_on_the_device_thread(
    executor: ThreadPoolExecutor,
) -> None:
    runner = ThreadRecordingRunner(delay_s=0.02)
    batcher = batcher_of(runner, executor, 0.005)
    await batcher.start()
    for value in range(3):
        await batcher.submit(Rows((value,)))
    await batcher.stop()
    assert threading.get_ident() not in runner.threads


async def test_no_batch_runs_on_the_loop_while_one_is_on_the_device_thread(
    executor: ThreadPoolExecutor,
) -> None:
    runner = ThreadRecordingRunner()
    batcher = batcher_of(runner, executor, 1.0, limit=1)
    await batcher.start()
    await batcher.submit(Rows((0,)))  # measured: short
    runner.gate = threading.Event()
    runner.delay_s = 0.0
    batcher.max_loop_batch_s = 0.0  # the next goes to the device thread, and is held there
    held = asyncio.create_task(batcher.submit(Rows((1,))))
    await asyncio.sleep(0.05)
    batcher.max_loop_batch_s = 1.0  # the one after is short, but one is in flight
    behind = asyncio.create_task(batcher.submit(Rows((2,))))
    await asyncio.sleep(0.05)
    assert not behind.done()
    runner.gate.set()
    assert await held == (2,)
    assert await behind == (4,)
    await batcher.stop()
    assert threading.get_ident() not in runner.threads[1:]
    assert [b[0].values for b in runner.batches] == [(0,), (1,), (2,)]


async def test_the_loop_turns_between_two_batches_it_runs(executor: ThreadPoolExecutor) -> None:
    runner = ThreadRecordingRunner()
    batcher = batcher_of(runner, executor, 1.0, limit=2)
    await batcher.start()
    await batcher.submit(Rows((0,)))
    events: list[str] = []
    loop = asyncio.get_running_loop()
    original = runner.run_batch

    def recording(parts: Sequence[Rows]) -> list[tuple[int, ...]]:
        events.append("batch")
        loop.call_soon(events.append, "turn")
        return original(parts)

    runner.run_batch = recording  # type: ignore[method-assign]
    answers = await asyncio.gather(*(batcher.submit(Rows((v,))) for v in range(1, 5)))
    await batcher.stop()
    assert answers == [(2,), (4,), (6,), (8,)]
    assert events == ["batch", "turn", "batch", "turn"]


async def test_a_poison_sample_fails_alone_on_the_loop(executor: ThreadPoolExecutor) -> None:
    runner = ThreadRecordingRunner(poison=3)
    batcher = batcher_of(runner, executor, 1.0)
    await batcher.start()
    await batcher.submit(Rows((0,)))
    results = await asyncio.gather(
        *(batcher.submit(Rows((v,))) for v in range(1, 6)), return_exceptions=True
    )
    await batcher.stop()
    assert isinstance(results[2], Poison)
    assert [r for i, r in enumerate(results) if i != 2] == [(2,), (4,), (8,), (10,)]
    assert set(runner.threads[1:]) == {threading.get_ident()}
