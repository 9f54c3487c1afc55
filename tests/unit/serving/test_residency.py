"""The on-demand residency policy: which models are evicted for a load, and when none can be."""

from __future__ import annotations

import pytest

from nograd.serving.errors import LargerThanLimit, NoRoomNow
from nograd.serving.residency.policy import (
    GRACE_WAIT_LOADS,
    POPULARITY_HALF_LIFE_S,
    POPULARITY_KEPT,
    Residency,
    Resident,
    choose_victims,
)
from nograd.settings import Settings

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def residency(limit_mib: int, *sizes: tuple[str, int]) -> Residency:
    """Models admitted in order (the first is the least recently used), ``sizes`` in MiB."""
    resident = Residency(limit_mib * MIB, clock=Clock())
    for name, size in sizes:
        resident.admit(name, size * MIB, pinned=False, load_seconds=1.0)
    return resident


def test_nothing_evicted_while_the_model_fits() -> None:
    resident = residency(30, ("a", 10), ("b", 10))
    assert resident.victims("c", 10 * MIB) == []


def test_least_recently_used_go_first_and_only_as_many_as_needed() -> None:
    resident = residency(30, ("a", 10), ("b", 10), ("c", 10))
    resident.touch("a")  # now b is the least recently used
    assert resident.victims("d", 10 * MIB) == ["b"]
    assert resident.victims("d", 20 * MIB) == ["b", "c"]


def test_ties_evict_the_quickest_to_load_again() -> None:
    slow = Resident("slow", 10 * MIB, last_used=1.0, load_seconds=9.0)
    quick = Resident("quick", 10 * MIB, last_used=1.0, load_seconds=0.5)
    assert choose_victims([slow, quick], "new", 10 * MIB, 20 * MIB) == ["quick"]


def test_a_held_model_is_never_evicted() -> None:
    resident = residency(30, ("a", 10), ("b", 10), ("c", 10))
    resident.hold("a")
    assert resident.victims("d", 10 * MIB) == ["b"]
    resident.hold("b")
    resident.hold("c")
    with pytest.raises(NoRoomNow, match="once the other models in use are idle"):
        resident.victims("d", 10 * MIB)
    assert resident.release("c")
    assert resident.victims("d", 10 * MIB) == ["c"]


def test_release_counts_every_hold() -> None:
    resident = residency(30, ("a", 10))
    resident.hold("a")
    resident.hold("a")
    assert not resident.release("a")
    assert resident.held("a")
    assert resident.release("a")
    assert not resident.held("a")


def test_a_pinned_model_is_never_evicted() -> None:
    resident = Residency(30 * MIB, clock=Clock())
    resident.admit("pinned", 10 * MIB, pinned=True, load_seconds=1.0)
    resident.admit("b", 10 * MIB, pinned=False, load_seconds=1.0)
    assert resident.victims("c", 20 * MIB) == ["b"]


def test_a_model_larger_than_the_limit_is_refused_naming_the_sizes() -> None:
    resident = residency(30, ("a", 10))
    with pytest.raises(LargerThanLimit, match=r"needs 40\.0 MiB.*limit of 30\.0 MiB"):
        resident.victims("big", 40 * MIB)


def test_pinned_models_count_against_what_any_model_may_take() -> None:
    resident = Residency(30 * MIB, clock=Clock())
    resident.admit("pinned", 20 * MIB, pinned=True, load_seconds=1.0)
    with pytest.raises(LargerThanLimit, match="always-resident"):
        resident.victims("big", 15 * MIB)


def test_the_model_itself_does_not_count_as_resident_room() -> None:
    """Room made again after a first load measured more than expected: its own bytes are not
    counted twice."""
    resident = residency(30, ("a", 10), ("b", 10))
    resident.admit("c", 15 * MIB, pinned=False, load_seconds=1.0)
    assert resident.victims("c", 15 * MIB) == ["a"]


def test_an_estimate_is_the_last_measured_size_else_the_files() -> None:
    resident = residency(30, ("a", 12))
    resident.evicted("a")
    assert resident.used == 0
    assert resident.estimate("a", on_disk=1) == (12 * MIB, 12 * MIB)
    assert resident.estimate("never", on_disk=5) == (5, 5)


def test_a_load_peak_counts_for_the_next_load_and_scales_first_loads_by_their_files() -> None:
    resident = residency(100)
    # 8 MiB of files held 9 MiB once loaded, 28 MiB at the height of the load.
    resident.admit("a", 9 * MIB, pinned=False, load_seconds=1.0, load_peak=28 * MIB, files=8 * MIB)
    resident.evicted("a")
    assert resident.estimate("a", on_disk=8 * MIB) == (9 * MIB, 28 * MIB)
    # A model never loaded: its files' size, and the peak per file byte seen (3.5).
    assert resident.estimate("new", on_disk=4 * MIB) == (4 * MIB, 14 * MIB)


def test_room_for_a_load_peak_comes_from_idle_models_only() -> None:
    resident = residency(30, ("a", 10), ("b", 10), ("c", 5))
    assert resident.idle_victims("d", 5 * MIB) == []
    resident.hold("a")
    # 25 MiB resident, 20 to make: b, then c (a is held); what cannot be freed is not waited for.
    assert resident.idle_victims("d", 20 * MIB) == ["b", "c"]
    assert resident.idle_victims("d", 40 * MIB) == ["b", "c"]
    assert resident.short_of("d", 20 * MIB)  # until a, held now, can go too
    for name in ("b", "c"):
        resident.evicted(name)
    assert not resident.short_of("d", 20 * MIB)
    resident.admit("p", 20 * MIB, pinned=True, load_seconds=1.0)
    resident.evicted("a")
    assert not resident.short_of("d", 20 * MIB)  # pinned: never evicted, nothing to wait for


def test_the_last_measured_load_time_outlives_the_eviction() -> None:
    resident = residency(30)
    resident.admit("a", MIB, pinned=False, load_seconds=2.5)
    resident.admit("b", MIB, pinned=False, load_seconds=0.0)  # counted, not measured
    resident.evicted("a")
    assert resident.load_seconds == {"a": 2.5}


@pytest.mark.parametrize(
    ("given", "expected"),
    [("256MiB", 256 * MIB), ("1.5 GiB", 3 * (1 << 29)), ("4096", 4096), ("64kib", 64 << 10)],
)
def test_memory_limit_reads_sizes(given: str, expected: int) -> None:
    assert Settings(memory_limit_bytes=given).memory_limit_bytes == expected


def test_memory_limit_refuses_an_unknown_unit() -> None:
    with pytest.raises(ValueError, match="not a size"):
        Settings(memory_limit_bytes="12 parsecs")


class StillClock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_model_asked_for_within_its_grace_is_not_evicted() -> None:
    """A model in steady use is idle between its requests; its grace (from its last request's
    arrival or answer) keeps it from eviction: the load must wait for the grace of another, or
    be refused, rather than evict it."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock, grace_s=1.0)
    resident.admit("hot", 10 * MIB, pinned=False, load_seconds=1.0)
    clock.now += 5.0
    resident.admit("cold", 10 * MIB, pinned=False, load_seconds=1.0)  # just loaded: in grace
    resident.hold("hot")
    clock.now += 0.5
    assert resident.release("hot")  # answered: its grace starts again
    clock.now += 0.25
    with pytest.raises(NoRoomNow, match="NOGRAD_EVICTION_GRACE_MS"):
        resident.victims("next", 10 * MIB)
    assert resident.idle_victims("next", 20 * MIB) == []
    assert resident.grace_ends_in("next") == pytest.approx(0.25)  # cold's, the first to end
    clock.now += 0.3
    assert resident.victims("next", 10 * MIB) == ["cold"]  # hot's grace still runs
    assert resident.grace_ends_in("next") == pytest.approx(0.45)
    resident.hold("hot")  # held: neither its grace nor its end counts
    assert resident.grace_ends_in("next") is None
    clock.now += 5.0
    with pytest.raises(NoRoomNow):
        resident.victims("next", 20 * MIB)
    resident.release("hot")
    clock.now += 1.0
    assert resident.victims("next", 20 * MIB) == ["cold", "hot"]


def test_a_popular_model_outlasts_one_asked_for_once_more_recently() -> None:
    """Skewed traffic: the model most asked for is spared though the clients waiting on loads
    made it the least recently used; a model asked for once goes first."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock)
    resident.admit("popular", 10 * MIB, pinned=False, load_seconds=1.0)
    for _ in range(5):
        resident.hold("popular")
        clock.now += 1.0
        resident.release("popular")
    resident.admit("once", 10 * MIB, pinned=False, load_seconds=1.0)
    resident.hold("once")
    clock.now += 1.0
    resident.release("once")
    assert resident.victims("next", 10 * MIB) == ["once"]
    assert resident.idle_victims("next", 10 * MIB) == ["once"]


def test_popularity_halves_with_its_half_life() -> None:
    """A model asked for often long ago counts less than one asked for now: popularity follows
    the traffic as it moves, and a model evicted keeps its count for its next load."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock)
    for _ in range(4):
        resident.hold("old")
        resident.release("old")
    resident.evicted("old")
    clock.now += 2 * POPULARITY_HALF_LIFE_S
    assert resident.popularity("old") == pytest.approx(1.0)
    resident.hold("new")
    resident.hold("new")
    assert resident.popularity("new") > resident.popularity("old")


def test_popularity_is_kept_for_a_bounded_number_of_names() -> None:
    """A client naming ever new models (each refused 404 later) leaves a bounded account."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock)
    resident.admit("kept", 10 * MIB, pinned=False, load_seconds=1.0)
    resident.hold("kept")
    for index in range(POPULARITY_KEPT + 10):
        clock.now += 0.001
        resident.hold(f"unknown-{index}")
        resident.release(f"unknown-{index}")
    assert len(resident.asked) <= POPULARITY_KEPT
    assert "kept" in resident.asked and f"unknown-{POPULARITY_KEPT + 9}" in resident.asked


def test_a_grace_keeps_out_only_models_asked_for_less() -> None:
    """Misses one after another: a model loaded for one request, still in its grace, makes
    room for the next model asked for as often (a load no longer waits for that grace), while
    the model in steady use keeps out both."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock, grace_s=1.0)
    resident.admit("steady", 10 * MIB, pinned=False, load_seconds=1.0)
    for _ in range(3):
        resident.hold("steady")
        clock.now += 0.1
        resident.release("steady")
    resident.hold("once")
    resident.admit("once", 10 * MIB, pinned=False, load_seconds=1.0)
    clock.now += 0.1
    resident.release("once")
    resident.hold("next")  # its request arrived: it is asked for once, as "once" was
    assert resident.victims("next", 10 * MIB) == ["once"]
    assert resident.grace_ends_in("next") == pytest.approx(0.9)  # steady's grace
    with pytest.raises(NoRoomNow, match="NOGRAD_EVICTION_GRACE_MS"):
        resident.victims("next", 20 * MIB)


def test_a_load_waits_for_a_grace_a_few_of_the_models_loads_at_most() -> None:
    """A model in its grace keeps out one asked for less, but a load waiting for that grace
    evicts it once it has waited ``GRACE_WAIT_LOADS`` times the model's last load, not the
    whole grace."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock, grace_s=1.0)
    resident.admit("head", 10 * MIB, pinned=False, load_seconds=0.03)
    resident.admit("steady", 10 * MIB, pinned=False, load_seconds=0.05)
    for _ in range(3):
        for name in ("head", "steady"):
            resident.hold(name)
            resident.release(name)
    resident.hold("head")  # in use, and asked for more than "steady"
    resident.hold("rare")  # the load's own request
    with pytest.raises(NoRoomNow):
        resident.victims("rare", 10 * MIB, waited_s=0.049 * GRACE_WAIT_LOADS)
    outwaited = 0.05 * GRACE_WAIT_LOADS  # steady's loads, well short of its grace
    assert outwaited < 1.0
    assert resident.grace_ends_in("rare") == pytest.approx(outwaited)
    assert resident.victims("rare", 10 * MIB, waited_s=outwaited) == ["steady"]
    assert resident.grace_ends_in("rare", waited_s=0.1) == pytest.approx(outwaited - 0.1)


def test_a_model_in_its_grace_is_kept_while_one_asked_for_less_is_only_held() -> None:
    """The wait bound does not evict a model in steady use while a model asked for less is held
    by a request: that one goes first once answered, however long the load waits."""
    clock = StillClock()
    resident = Residency(20 * MIB, clock=clock, grace_s=1.0)
    resident.admit("hot", 10 * MIB, pinned=False, load_seconds=0.02)
    for _ in range(10):
        resident.hold("hot")
        resident.release("hot")
    resident.admit("cold", 10 * MIB, pinned=False, load_seconds=0.02)
    resident.hold("cold")  # its request still running
    resident.hold("next")
    with pytest.raises(NoRoomNow):
        resident.victims("next", 10 * MIB, waited_s=0.5)
    resident.release("cold")
    assert resident.victims("next", 10 * MIB, waited_s=0.5) == ["cold"]
