"""The cores one process's CPU batches share (``BatchCores``) and how many it runs at once
(``planned_cpu_batches``); threads here stand for the device threads that run the batches."""

from __future__ import annotations

import random
import threading
import time

import pytest

from nograd.host.cpu_batches import AUTO_CPU_BATCHES, BatchCores, planned_cpu_batches
from nograd.host.ledger import BUSY_HOLD_S


def test_a_lone_batch_takes_every_core_and_gives_them_back() -> None:
    cores = BatchCores(4)
    assert cores.acquire() == 4
    assert cores.held() == 4
    cores.release()
    assert cores.held() == 0


def test_a_short_forward_asks_for_fewer_and_gets_no_more() -> None:
    cores = BatchCores(4)
    assert cores.acquire(1) == 1
    cores.release()


def _in_thread(cores: BatchCores, taken: list[int], hold: threading.Event) -> threading.Thread:
    def run() -> None:
        taken.append(cores.acquire())
        hold.wait(5)
        cores.release()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_batch_beside_a_running_one_gets_the_cores_it_leaves() -> None:
    cores = BatchCores(4)
    assert cores.acquire(2) == 2  # a batch runs on two
    taken: list[int] = []
    hold = threading.Event()
    beside = _in_thread(cores, taken, hold)
    deadline = time.monotonic() + 5
    while not taken and time.monotonic() < deadline:
        time.sleep(0.001)
    assert taken == [2]  # the two left free, not all four
    hold.set()
    beside.join(5)
    cores.release()
    assert cores.held() == 0


def test_under_load_a_batch_leaves_a_core_to_the_thread_whose_batch_just_ended() -> None:
    """Batch A holds every core; B waits. When A ends, B takes half, not all, though it is
    alone for that moment: A's successor (C) then gets the other half at once. Once the load is
    gone (no batch for ``BUSY_HOLD_S``), a lone batch runs wide again."""
    cores = BatchCores(2)
    assert cores.acquire() == 2  # A, alone: every core
    taken: list[int] = []
    hold = threading.Event()
    waiting = _in_thread(cores, taken, hold)  # B
    time.sleep(0.05)
    assert taken == [], "B ran while A held every core"
    cores.release()  # A ends
    deadline = time.monotonic() + 5
    while not taken and time.monotonic() < deadline:
        time.sleep(0.001)
    assert taken == [1]
    assert cores.acquire() == 1  # C, beside B
    assert cores.held() == 2
    cores.release()
    hold.set()
    waiting.join(5)
    assert cores.held() == 0
    time.sleep(BUSY_HOLD_S + 0.02)
    assert cores.acquire() == 2  # load gone: a lone batch runs wide again
    cores.release()


def test_consecutive_batches_of_one_thread_run_wide() -> None:
    """At one request at a time the same device thread runs every batch: its own last batch
    holds nothing back."""
    cores = BatchCores(2)
    for _ in range(3):
        assert cores.acquire() == 2
        cores.release()


def test_the_batches_never_hold_more_than_the_cores() -> None:
    cores = BatchCores(3)
    seen: list[int] = []
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                cores.acquire(rng.choice([None, 1, 2]))
                seen.append(cores.held())
                time.sleep(rng.random() / 5000)
                cores.release()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert len(seen) == 600
    assert max(seen) <= 3
    assert cores.held() == 0


@pytest.mark.parametrize(
    ("setting", "beside_fronts", "shared", "cores", "expected"),
    [
        (3, False, False, 1, 3),  # a number is the operator's
        ("auto", True, True, 2, 2),  # an engine beside fronts, cores shared
        ("auto", True, True, 16, AUTO_CPU_BATCHES),
        ("auto", True, True, 1, 1),  # one core: one batch
        ("auto", False, True, 8, 1),  # a worker, or a single process
        ("auto", True, False, 8, 1),  # fixed torch_threads, or models loaded on demand
    ],
)
def test_auto_runs_batches_side_by_side_only_in_an_engine_sharing_its_cores(
    setting: int | str, beside_fronts: bool, shared: bool, cores: int, expected: int
) -> None:
    assert planned_cpu_batches(setting, beside_fronts, shared, cores) == expected


def test_every_waiting_batch_gets_a_core_the_ending_one_frees() -> None:
    """Four cores held by one batch, two waiting: when it ends both start, one core each (and
    one for the thread whose batch just ended), not one after the other."""
    cores = BatchCores(4)
    assert cores.acquire() == 4
    taken: list[int] = []
    hold = threading.Event()
    waiting = [_in_thread(cores, taken, hold) for _ in range(2)]
    time.sleep(0.05)
    assert taken == []
    cores.release()
    deadline = time.monotonic() + 5
    while len(taken) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(taken) == 2 and sum(taken) <= 3
    hold.set()
    for thread in waiting:
        thread.join(5)
    assert cores.held() == 0
