"""The ledger of CPU cores shared by worker processes: each "worker" here is a CoreLedger on the
same file, as each process opens its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.host import ledger as cores_module
from nograd.host.ledger import CoreLedger, CoreShare, clear_slot, create_ledger
from nograd.runtime import runners as runners_module
from nograd.runtime.handler import ModelHandler, TensorPart
from nograd.runtime.runners import SharedCoresRunner, batch_runner
from nograd.schema.config import ModelConfig, TensorSpec


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    path = tmp_path / "cores.i64"
    create_ledger(path, 3)
    return path


@pytest.fixture
def workers(ledger_path: Path) -> Iterator[list[CoreLedger]]:
    ledgers = [CoreLedger(CoreShare(ledger_path, i), cores=4) for i in range(3)]
    yield ledgers
    for ledger in ledgers:
        ledger.close()


def test_a_lone_worker_takes_every_core_and_gives_them_back(workers: list[CoreLedger]) -> None:
    a = workers[0]
    assert a.acquire() == 4
    assert a.held() == [4, 0, 0]
    a.release()
    assert a.held() == [0, 0, 0]
    assert a.acquire(most=1) == 1, "a short forward asks for one thread"


def test_busy_workers_leave_each_other_a_core(workers: list[CoreLedger]) -> None:
    a, b, c = workers
    b.set_active(True)
    c.set_active(True)
    assert a.try_acquire() == 2, "4 cores, two other workers with requests in flight: ceil(4/3)"
    assert b.try_acquire() == 1, "a's batch holds 2, c is busy: 1 of the 2 left"
    assert c.try_acquire() == 1
    assert a.held() == [2, 1, 1]
    assert sum(a.held()) <= a.cores


def test_with_every_core_held_a_worker_waits_and_the_holder_leaves_it_one(
    workers: list[CoreLedger],
) -> None:
    a, b, _ = workers
    assert a.try_acquire() == 4
    assert b.try_acquire() == 0, "nothing free: b waits"
    a.release()
    assert a.try_acquire() == 2, "b is waiting: a takes its fair half"
    assert b.try_acquire() == 2
    assert b.held() == [2, 2, 0]


def test_acquire_blocks_until_a_core_is_released(workers: list[CoreLedger]) -> None:
    a, b, _ = workers
    assert a.acquire() == 4
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire()))
    waiter.start()
    time.sleep(0.05)
    assert got == [] and waiter.is_alive()
    a.release()
    waiter.join(timeout=5)
    assert got == [4], "a left and is idle: b may take every core"


class FakeClock:
    """Stands in for the ``time`` module inside nograd.host.ledger."""

    def __init__(self) -> None:
        self.now_ns = 10**12

    def monotonic_ns(self) -> int:
        return self.now_ns

    def sleep(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


def test_a_worker_stays_busy_for_a_while_after_its_last_request(
    workers: list[CoreLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _ = workers
    clock = FakeClock()
    monkeypatch.setattr(cores_module, "time", clock)
    b.set_active(True)
    b.set_active(False)
    clock.now_ns += int(0.09e9)
    assert a.try_acquire() == 2, "b's requests left 90 ms ago: more are likely on their way"
    a.release()
    clock.now_ns += int(0.02e9)
    assert a.try_acquire() == 4, "110 ms later b counts as idle"


def test_a_dead_workers_slot_is_cleared(ledger_path: Path, workers: list[CoreLedger]) -> None:
    a, b, _ = workers
    assert a.try_acquire() == 4
    a.set_active(True)
    clear_slot(ledger_path, 0)
    assert b.held() == [0, 0, 0]
    assert b.try_acquire() == 4, "nothing is left held or busy by the dead worker"


def test_busy_workers_split_many_cores_fairly(tmp_path: Path) -> None:
    """8 cores, two busy workers: 4 each, not 7 to whoever asks first and 1 to the other."""
    path = tmp_path / "cores.i64"
    create_ledger(path, 2)
    a, b = (CoreLedger(CoreShare(path, i), cores=8) for i in range(2))
    try:
        a.set_active(True)
        b.set_active(True)
        assert a.try_acquire() == 4
        assert b.try_acquire() == 4
        a.release()
        assert a.try_acquire() == 4, "b still holds its half"
        a.release()
        b.release()
        b.set_active(False)
        b.clear()
        assert a.try_acquire() == 8, "alone again: every core"
    finally:
        a.close()
        b.close()


def test_a_slot_outside_the_ledger_is_refused(ledger_path: Path) -> None:
    with pytest.raises(ValueError, match="slot 3 is outside"):
        CoreLedger(CoreShare(ledger_path, 3), cores=2)


class Slow(torch.nn.Module):
    """A forward long enough to count as worth widening, or not."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.threads: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append(torch.get_num_threads())
        time.sleep(self.seconds)
        return x * 2


def runner_with(ledger: CoreLedger, seconds: float) -> tuple[SharedCoresRunner, Slow]:
    module = Slow(seconds)
    config = ModelConfig(
        name="slow",
        weights=None,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
    )
    runner = batch_runner(ModelHandler(module, config, torch.device("cpu")), ledger)
    assert isinstance(runner, SharedCoresRunner)
    return runner, module


def part() -> TensorPart:
    return TensorPart({"x": np.ones((1, 2), dtype=np.float32)}, 1)


def test_the_runner_sets_each_batchs_threads_from_the_ledger(
    workers: list[CoreLedger], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _ = workers
    before = torch.get_num_threads()
    try:
        runner, module = runner_with(a, seconds=0.01)
        runner.run_batch([part()])
        b.set_active(True)
        runner.run_batch([part()])
        b.set_active(False)
        b.clear()
        assert module.threads == [4, 2], "alone: every core; b busy: a fair half"
        assert a.held() == [0, 0, 0], "released after each batch"

        # Any real forward is short next to a minute: the first batch (not yet timed) is wide,
        # the next one, after a "short" forward, narrow; a busy machine cannot flip it.
        monkeypatch.setattr(runners_module, "WIDE_FORWARD_S", 60.0)
        quick, fast_module = runner_with(a, seconds=0.0)
        quick.run_batch([part()])
        quick.run_batch([part()])
        assert fast_module.threads == [4, 1], "a forward shorter than the bar stays on one thread"
    finally:
        torch.set_num_threads(before)
