"""When the serving core hands free heap memory back: after a large request is answered, in a
worker thread, at most once per interval; never for ordinary requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from nograd.serving.calls import heap_return
from nograd.serving.calls.heap_return import HeapReturn, input_bytes


def texts(count: int, size: int) -> dict[str, np.ndarray]:
    array = np.empty(count, dtype=np.object_)
    array[:] = [b"x" * size] * count
    return {"text": array}


class Releases:
    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self) -> bool:
        self.threads.append(threading.current_thread().name)
        return True


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Poll: the release finishes in a worker thread, which sets no event the test could await."""
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not true within {timeout_s} s")


def test_input_bytes_counts_texts_and_tensors_and_stops_early() -> None:
    assert input_bytes(texts(3, 100), stop_at=10_000) == 300
    assert input_bytes({"x": np.zeros((4, 8), dtype=np.float32)}, stop_at=10_000) == 128
    # Counting stops at the first text that reaches the bound.
    assert input_bytes(texts(1000, 100), stop_at=250) == 300


def test_only_requests_from_the_threshold_are_large() -> None:
    trim = HeapReturn(large_bytes=1000, release=Releases())
    assert not trim.is_large(texts(9, 100))
    assert trim.is_large(texts(10, 100))


def test_nothing_is_large_where_memory_cannot_be_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(heap_return, "can_release", lambda: False)
    assert not HeapReturn(large_bytes=1).is_large(texts(10, 100))


async def test_answered_ordinary_requests_release_nothing() -> None:
    releases = Releases()
    trim = HeapReturn(large_bytes=1000, release=releases)
    for _ in range(5):
        trim.answered()
    await asyncio.sleep(0.05)
    assert releases.threads == []


async def test_a_large_request_releases_once_answered_off_the_event_loop() -> None:
    releases = Releases()
    trim = HeapReturn(large_bytes=1000, release=releases)
    trim.finished_large()
    await asyncio.sleep(0.05)
    assert releases.threads == [], "not before its answer is sent"
    trim.answered()
    trim.answered()
    await until(lambda: trim.releases == 1)
    await asyncio.sleep(0.05)
    assert len(releases.threads) == 1
    assert releases.threads[0] != threading.current_thread().name


async def test_large_requests_in_a_row_release_at_most_once_per_interval() -> None:
    releases = Releases()
    trim = HeapReturn(large_bytes=1000, interval_s=0.3, release=releases)
    trim.finished_large()
    trim.answered()
    await until(lambda: trim.releases == 1)
    loop = asyncio.get_running_loop()
    first = loop.time()
    for _ in range(3):
        trim.finished_large()
        trim.answered()
    await asyncio.sleep(0.15)
    assert trim.releases == 1, "the second waits for the interval"
    await until(lambda: trim.releases == 2)
    assert loop.time() - first >= 0.25
    await asyncio.sleep(0.4)
    assert trim.releases == 2, "the three answered together share one release"


async def test_a_large_request_finishing_during_a_release_gets_one_after_it() -> None:
    started = threading.Event()
    go_on = threading.Event()

    def slow_release() -> bool:
        started.set()
        go_on.wait(2)
        return True

    trim = HeapReturn(large_bytes=1000, interval_s=0.05, release=slow_release)
    trim.finished_large()
    trim.answered()
    await until(started.is_set)
    trim.finished_large()
    trim.answered()  # a release is under way: this one follows it
    go_on.set()
    await until(lambda: trim.releases == 2)


async def test_a_failing_release_is_logged_and_the_next_one_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    def failing() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("boom")
        return True

    trim = HeapReturn(large_bytes=1000, interval_s=0.0, release=failing)
    trim.finished_large()
    trim.answered()
    await until(lambda: len(calls) == 1)
    await asyncio.sleep(0.02)
    assert "boom" in caplog.text
    trim.finished_large()
    trim.answered()
    await until(lambda: trim.releases == 1)
