"""Room for a load: how long a load waits out the graces that keep its room, alone and with
other loads queued behind it (real waits, bounded to well under a second each)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from nograd.serving.errors import NoRoomNow
from nograd.serving.residency.policy import GRACE_WAIT_LOADS, Residency
from nograd.serving.residency.room import LAST_LOOK_S, RoomForLoads

MIB = 1 << 20
LOAD_S = 0.01
"""Each resident model's last load: a load with others behind it outwaits a grace after
``GRACE_WAIT_LOADS`` of them."""
BOUND_S = 0.6
"""The room's wait bound: a load alone takes a graced model at its last look."""


def full_residency() -> Residency:
    """Two models in steady use (long graces) fill the limit; "rare" is asked for once."""
    resident = Residency(20 * MIB, grace_s=30.0)
    for name in ("steady", "busy"):
        resident.admit(name, 10 * MIB, pinned=False, load_seconds=LOAD_S)
    for _ in range(3):
        for name in ("steady", "busy"):
            resident.hold(name)
            resident.release(name)
    resident.hold("busy")  # asked once more: "steady" is the least asked for
    resident.release("busy")
    resident.hold("rare")
    return resident


class Room:
    """A ``RoomForLoads`` over ``full_residency``, recording what it evicts and when."""

    def __init__(self, loading: set[str], wait_s: float = BOUND_S) -> None:
        self.residency = full_residency()
        self.loading = loading
        self.evicted: list[tuple[str, float]] = []
        self.started = time.monotonic()
        self.room = RoomForLoads(self.residency, wait_s, Counter(), loading, self._evict)

    async def _evict(self, name: str, reason: str) -> bool:
        assert reason == "memory"
        self.evicted.append((name, time.monotonic() - self.started))
        self.residency.evicted(name)
        return True


def test_a_load_alone_waits_for_a_grace_until_its_last_look() -> None:
    """Alone, a load takes a model only its grace keeps as its bound ends, not after a few
    loads: a grace that ends first would free a model no longer asked for."""

    async def scenario() -> Room:
        room = Room({"rare"})
        await room.room.make_room("rare", 10 * MIB)
        return room

    room = asyncio.run(scenario())
    [(name, at)] = room.evicted
    assert name == "steady"
    assert BOUND_S - LAST_LOOK_S - 0.02 <= at < BOUND_S
    assert at > 3 * LOAD_S * GRACE_WAIT_LOADS


def test_a_load_with_others_queued_behind_it_outwaits_a_grace_after_a_few_loads() -> None:
    """Every second a load waits stalls the loads behind it: it takes the least asked for
    graced model after ``GRACE_WAIT_LOADS`` of that model's loads."""

    async def scenario() -> Room:
        room = Room({"rare", "other"})
        await room.room.make_room("rare", 10 * MIB)
        return room

    room = asyncio.run(scenario())
    [(name, at)] = room.evicted
    assert name == "steady"
    assert LOAD_S * GRACE_WAIT_LOADS - 0.02 <= at < BOUND_S - LAST_LOOK_S - 0.1


def test_a_load_queued_behind_a_waiting_one_cuts_its_wait_short() -> None:
    """A load waiting alone looks again when another load queues: it has waited its few loads
    already, so it makes room at once instead of at its last look."""

    async def scenario() -> tuple[Room, float]:
        room = Room({"rare"})
        waiting = asyncio.create_task(room.room.make_room("rare", 10 * MIB))
        await asyncio.sleep(0.2)
        assert not room.evicted
        room.loading.add("other")
        queued_at = time.monotonic() - room.started
        room.room.look_again()
        await waiting
        return room, queued_at

    room, queued_at = asyncio.run(scenario())
    [(name, at)] = room.evicted
    assert name == "steady"
    assert queued_at <= at < queued_at + 0.05


def test_a_held_model_is_still_waited_for_to_the_bound_and_refused() -> None:
    """The last look takes graced models, never held ones: a load whose room requests hold is
    refused at its bound as before."""

    async def scenario() -> Room:
        room = Room({"rare"}, wait_s=0.3)
        room.residency.hold("steady")
        room.residency.hold("busy")
        with pytest.raises(NoRoomNow):
            await room.room.make_room("rare", 10 * MIB)
        return room

    started = time.monotonic()
    room = asyncio.run(scenario())
    assert room.evicted == []
    assert time.monotonic() - started >= 0.3
