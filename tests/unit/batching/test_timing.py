"""The batch-time fit behind the queue's expected wait."""

from __future__ import annotations

import pytest

from nograd.batching.timing import BatchTiming


def test_unknown_until_a_batch_has_run() -> None:
    timing = BatchTiming()
    assert not timing.known
    assert timing.queue_s(1000, 100) == 0.0
    timing.observe(0, 0.01)  # a batch of nothing teaches nothing
    assert not timing.known


def test_batches_of_one_size_give_a_figure_per_unit_of_cost() -> None:
    timing = BatchTiming()
    for _ in range(5):
        timing.observe(4, 0.05)
    assert timing.fit == pytest.approx((0.0, 0.0125))
    assert timing.queue_s(40, 4) == pytest.approx(0.5)


def test_a_fixed_part_is_learned_from_batches_of_different_sizes() -> None:
    # 5 ms per batch plus 0.1 ms per token: small batches alone would say 0.35 ms per token.
    timing = BatchTiming()
    for cost in (20, 30, 25, 960, 20, 500, 30):
        timing.observe(cost, 0.005 + 0.0001 * cost)
    fixed, per_cost = timing.fit
    assert fixed == pytest.approx(0.005, rel=1e-6)
    assert per_cost == pytest.approx(0.0001, rel=1e-6)
    # 6,400 tokens queued, batches of at most 1,024: seven batches' fixed part, not 6,400.
    assert timing.queue_s(6400, 1024) == pytest.approx(7 * 0.005 + 0.64)
    assert timing.batch_s(1024) == pytest.approx(0.005 + 0.1024)


def test_the_latest_batches_weigh_most() -> None:
    timing = BatchTiming()
    for _ in range(10):
        timing.observe(10, 1.0)  # a stalled device
    for _ in range(30):
        timing.observe(10, 0.01)
    assert timing.batch_s(10) < 0.02


def test_a_fit_that_makes_no_sense_falls_back_to_a_figure_per_unit() -> None:
    timing = BatchTiming()
    # Bigger batches faster (noise): a negative slope is refused.
    timing.observe(10, 0.05)
    timing.observe(100, 0.01)
    fixed, per_cost = timing.fit
    assert fixed == 0.0 and per_cost == pytest.approx((0.8 * 0.05 + 0.01) / (0.8 * 10 + 100))


def test_a_batch_paused_midway_is_learned_as_a_slow_batch_not_as_the_pause() -> None:
    timing = BatchTiming()
    for _ in range(10):
        timing.observe(100, 0.1)
    timing.observe(100, 30.0)  # the process was stopped for 30 s during this batch
    assert timing.batch_s(100) < 0.4
    # A device that really became slower is followed within a few batches.
    for _ in range(10):
        timing.observe(100, 1.0)
    assert timing.batch_s(100) > 0.8
