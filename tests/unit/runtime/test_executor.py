"""The CPU device's threads when a process runs several batches at once: the thread idle most
recently takes the next task, a second runs only while the first is busy, waiting tasks keep
their order, and a shutdown ends every thread."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError

import pytest

from nograd.runtime.executor import LastIdleExecutor


def name() -> str:
    return threading.current_thread().name


def test_consecutive_tasks_run_on_the_thread_that_ran_the_last() -> None:
    executor = LastIdleExecutor(3, "cpu")
    try:
        names = {executor.submit(name).result(5) for _ in range(20)}
        assert len(names) == 1
    finally:
        executor.shutdown()


def test_a_second_task_runs_beside_a_busy_one_and_a_third_waits_its_turn() -> None:
    executor = LastIdleExecutor(2, "cpu")
    release = threading.Event()
    started: list[str] = []

    def held(tag: str) -> str:
        started.append(tag)
        release.wait(5)
        return name()

    try:
        first = executor.submit(held, "a")
        second = executor.submit(held, "b")
        third = executor.submit(held, "c")
        deadline = time.monotonic() + 5
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)
        assert sorted(started) == ["a", "b"]  # both threads busy: c waits
        release.set()
        assert first.result(5) != second.result(5)
        assert third.result(5) in {first.result(), second.result()}
        assert started[2:] == ["c"]
    finally:
        executor.shutdown()


def test_waiting_tasks_run_in_the_order_they_came() -> None:
    executor = LastIdleExecutor(1, "cpu")
    order: list[int] = []
    try:
        futures = [executor.submit(order.append, i) for i in range(50)]
        for future in futures:
            future.result(5)
        assert order == list(range(50))
    finally:
        executor.shutdown()


def test_a_failing_task_fails_its_future_alone() -> None:
    executor = LastIdleExecutor(2, "cpu")
    try:
        with pytest.raises(ZeroDivisionError):
            executor.submit(lambda: 1 / 0).result(5)
        assert executor.submit(lambda x, y=0: x + y, 1, y=2).result(5) == 3
    finally:
        executor.shutdown()


def test_a_shutdown_cancels_the_waiting_and_ends_every_thread() -> None:
    executor = LastIdleExecutor(2, "cpu")
    release = threading.Event()
    running = [executor.submit(release.wait, 5) for _ in range(2)]
    waiting = executor.submit(name)
    time.sleep(0.02)
    threading.Timer(0.05, release.set).start()
    executor.shutdown(wait=True, cancel_futures=True)
    assert all(future.result(0) for future in running)
    with pytest.raises(CancelledError):
        waiting.result(0)
    assert not any(t.name.startswith("cpu-") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(name)


async def test_the_event_loop_runs_work_on_it() -> None:
    executor = LastIdleExecutor(2, "cpu")
    try:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(executor, time.sleep, 0.02) for _ in range(4))
        )
        assert results == [None] * 4
    finally:
        executor.shutdown()
