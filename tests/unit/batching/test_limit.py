"""The batch limit: halved on out-of-memory, climbing back, bounded by a cap."""

from __future__ import annotations

import pytest

from nograd.batching import (
    BatchLimit,
)


def test_a_cap_bounds_the_limit_without_touching_what_memory_taught() -> None:
    limit = BatchLimit(64, recover_after=3, forget_after=1000)
    limit.set_cap(16)
    assert limit.current == 16 and limit.measured == 64 and limit.cap == 16
    assert limit.changed() is True and limit.changed() is False
    limit.record_out_of_memory(12)
    assert limit.current == 6, "an OOM below the cap still halves the limit"
    for _ in range(300):
        limit.record_success(limit.current)
    assert limit.current == 11, "climbs back to the OOM ceiling, which is below the cap"
    limit.set_cap(None)
    assert limit.current == 11 and limit.ceiling == 11
    with pytest.raises(ValueError, match="at least 1"):
        limit.set_cap(0)


def test_limit_halves_on_oom_and_climbs_back_to_the_ceiling() -> None:
    limit = BatchLimit(64, recover_after=3, forget_after=1000)
    limit.record_out_of_memory(40)
    assert limit.current == 20 and limit.ceiling == 39
    assert limit.changed() is True and limit.changed() is False
    for _ in range(30):
        limit.record_success(limit.current)
    assert limit.current == 39, "climbs back but never above the OOM ceiling"
    for _ in range(1000):
        limit.record_success(limit.current)
    assert limit.current == 64, "a long run of successes forgets the OOM"
