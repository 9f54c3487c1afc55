"""Which models stay resident under a memory limit (``NOGRAD_MODEL_CONTROL=on_demand``).

The policy alone, without torch or the event loop: what each resident model holds, how often and
when it was last asked for and whether a request holds it; which to evict, the least asked for
first (requests counted with a half-life, ``POPULARITY_HALF_LIFE_S``; ties: the least recently
used, then the quickest to load again), so that a model to load fits. Under skewed traffic a
model asked for once leaves before a popular one that a burst of misses made the least recently
used. A model a request holds (queued, running, or still being read) and a pinned one are never
chosen, nor one asked for within the grace period (``grace_s``, from its last request's arrival
or answer) for a model asked for less: a client cycling through cold models cannot evict a model
in steady use between two of its requests, while a model loaded for one request does not make
the next miss wait for its grace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from nograd.serving.errors import LargerThanLimit, NoRoomNow

MIB = 1 << 20

POPULARITY_HALF_LIFE_S = 60.0
"""How long until a request counts half towards its model's popularity (what evictions spare):
long enough to tell a popular model from one asked for once, short enough that a model no longer
asked for stops counting as popular within minutes."""

GRACE_WAIT_LOADS = 10
"""A load waiting for room that only the grace of models asked for no less keeps evicts the
least asked for of them once it has waited this many times that model's last load (the room
counts a load's wait so only while other loads queue behind it: ``nograd.serving.residency.room``):
loads made to wait this way take at most about a tenth of the time (a client cycling through
cold models does not take the cores from a model in steady use), while the misses queued behind
a rarely asked model wait a few of its loads, not a whole grace."""

POPULARITY_KEPT = 4096
"""Most model names whose popularity is kept: past it, the least asked for half of the models
not resident are forgotten (a client naming models that do not exist holds nothing for good)."""


def mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


@dataclass
class Resident:
    """One resident model as the policy sees it."""

    name: str
    bytes: int
    """What it holds while resident, as measured at its load (see ``Residency.admit``)."""
    last_used: float = 0.0
    pinned: bool = False
    load_seconds: float = 0.0
    """How long it took to load: the cost of loading it again."""


@dataclass
class Residency:
    """The resident set of one process and its limit in bytes."""

    limit: int
    clock: Callable[[], float] = time.monotonic
    grace_s: float = 0.0
    """How long after its last request a model is not evicted (``NOGRAD_EVICTION_GRACE_MS``)."""
    resident: dict[str, Resident] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    """Requests holding each model (resident or not yet: a load waiting holds its model)."""
    measured: dict[str, int] = field(default_factory=dict)
    """The bytes each model measured when last resident: the estimate of its next load."""
    load_seconds: dict[str, float] = field(default_factory=dict)
    """How long each model's last load took: what a request waits for its next one."""
    load_peaks: dict[str, int] = field(default_factory=dict)
    """The most each model's load held at once, above the memory before it: a load reads its
    files and builds engine sessions beside what the model keeps once loaded."""
    peak_per_file_byte: float = 1.0
    """The largest ratio seen of a load's peak to the size of the model's files: what a first
    load of a model is expected to take per byte of its files."""
    asked: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per model, resident or not, its requests counted with a half-life and when that count was
    last brought up to date (``popularity``): a model evicted and loaded again keeps its count."""

    @property
    def used(self) -> int:
        return sum(r.bytes for r in self.resident.values())

    def touch(self, name: str) -> None:
        entry = self.resident.get(name)
        if entry is not None:
            entry.last_used = self.clock()

    def hold(self, name: str) -> None:
        self.holds[name] = self.holds.get(name, 0) + 1
        now = self.clock()
        self.asked[name] = (self._decayed(name, now) + 1.0, now)
        if len(self.asked) > POPULARITY_KEPT:
            self._forget_the_least_asked(now)
        self.touch(name)

    def _forget_the_least_asked(self, now: float) -> None:
        """Forget the least asked for half of the models not resident."""
        others = sorted(
            (name for name in self.asked if name not in self.resident),
            key=lambda other: self._decayed(other, now),
        )
        for name in others[: max(1, len(others) // 2)]:
            del self.asked[name]

    def popularity(self, name: str) -> float:
        """The requests for ``name`` so far, each halved every ``POPULARITY_HALF_LIFE_S``."""
        return self._decayed(name, self.clock())

    def _decayed(self, name: str, now: float) -> float:
        count, since = self.asked.get(name, (0.0, now))
        return float(count * 0.5 ** ((now - since) / POPULARITY_HALF_LIFE_S))

    def release(self, name: str) -> bool:
        """One request for ``name`` is answered (its grace starts again); True when none holds
        it any more."""
        self.touch(name)
        left = self.holds.get(name, 0) - 1
        if left > 0:
            self.holds[name] = left
            return False
        self.holds.pop(name, None)
        return True

    def held(self, name: str) -> bool:
        return self.holds.get(name, 0) > 0

    def in_grace(self, name: str) -> bool:
        """Whether ``name`` was asked for within the grace period."""
        entry = self.resident.get(name)
        return entry is not None and self.clock() - entry.last_used < self.grace_s

    def kept(self, name: str) -> bool:
        """Whether ``name`` may not be evicted now: a request holds it or it is in its grace."""
        return self.held(name) or self.in_grace(name)

    def kept_from(self, incoming: str, waited_s: float = 0.0) -> Callable[[str], bool]:
        """Whether a model may not be evicted for ``incoming``, whose load has waited
        ``waited_s`` for room: a request holds it, or its grace keeps it (``graced``) unless it
        is the model ``_outwaited`` names and the load has waited that long. A model loaded for
        one request does not keep out the next model asked for as often; a model in steady use
        keeps out every model asked for less."""
        graced = self.graced(incoming)
        outwaited = self._outwaited(graced)
        kept = {r.name for r in graced}
        if outwaited is not None and outwaited[1] <= waited_s:
            kept.discard(outwaited[0])
        return lambda name: self.held(name) or name in kept

    def graced(self, incoming: str) -> list[Resident]:
        """The models besides ``incoming`` that only their grace keeps from its load: not held,
        not pinned, in their grace and asked for at least as much as ``incoming``
        (``popularity``)."""
        wanted = self.popularity(incoming)
        return [
            r
            for r in self.resident.values()
            if r.name != incoming
            and not r.pinned
            and not self.held(r.name)
            and self.in_grace(r.name)
            and self.popularity(r.name) >= wanted
        ]

    def _outwaited(self, graced: list[Resident]) -> tuple[str, float] | None:
        """The model of ``graced`` a load waiting for room evicts despite its grace, and after
        how long a wait (``GRACE_WAIT_LOADS`` times its last load): the least asked for. None
        while a resident model asked for no more than it is held (it goes first once answered;
        the loading model itself, resident when its first load measured more than expected,
        makes room by leaving instead), or when ``graced`` is empty."""
        if not graced:
            return None
        least = min(graced, key=eviction_order(self.popularity))
        if least.load_seconds <= 0 or any(
            self.held(n) and self.popularity(n) <= self.popularity(least.name)
            for n in self.resident
        ):
            return None
        return least.name, least.load_seconds * GRACE_WAIT_LOADS

    def grace_ends_in(self, name: str, waited_s: float = 0.0) -> float | None:
        """Seconds until the first model besides ``name`` that only its grace keeps (``graced``)
        may be evicted by a load of ``name`` that has waited ``waited_s`` (``kept_from``); None
        when no model is kept by its grace alone."""
        now = self.clock()
        graced = self.graced(name)
        outwaited = self._outwaited(graced)
        ends = []
        for r in graced:
            end = r.last_used + self.grace_s - now
            if outwaited is not None and outwaited[0] == r.name:
                if outwaited[1] <= waited_s:
                    continue  # evictable already
                end = min(end, outwaited[1] - waited_s)
            ends.append(end)
        return max(0.0, min(ends)) if ends else None

    def admit(
        self,
        name: str,
        size: int,
        pinned: bool,
        load_seconds: float,
        load_peak: int = 0,
        files: int = 0,
    ) -> None:
        """``name`` is resident, holding ``size`` bytes (measured at its load); its load rose
        ``load_peak`` bytes at most, from ``files`` bytes of files (0: not measured)."""
        self.measured[name] = size
        if load_seconds > 0:
            self.load_seconds[name] = load_seconds
        if load_peak > 0:
            self.load_peaks[name] = load_peak
            if files > 0:
                self.peak_per_file_byte = max(self.peak_per_file_byte, load_peak / files)
        self.resident[name] = Resident(name, size, self.clock(), pinned, load_seconds)

    def resize(self, name: str, size: int) -> None:
        """``name``, resident, holds ``size`` bytes from now on (its memory measured again)."""
        entry = self.resident.get(name)
        if entry is not None:
            entry.bytes = size
            self.measured[name] = size

    def evicted(self, name: str) -> None:
        self.resident.pop(name, None)

    def estimate(self, name: str, on_disk: int) -> tuple[int, int]:
        """What loading ``name`` will take: what it holds once loaded (as measured when it was
        last resident, else its files' size) and the most its load holds at once (its last
        load's peak, else its files' size times the largest peak per file byte seen here)."""
        if name in self.measured:
            held = self.measured[name]
            return held, max(held, self.load_peaks.get(name, held))
        return on_disk, max(on_disk, int(on_disk * self.peak_per_file_byte))

    def victims(self, name: str, needed: int, waited_s: float = 0.0) -> list[str]:
        """The resident models to evict so that ``needed`` more bytes fit for ``name``, whose
        load has waited ``waited_s`` for room (as the room counts it: ``-inf`` outwaits no
        grace, ``inf`` every one it may), the least asked for first (ties: the least
        recently used, then the quickest to load again); ``LargerThanLimit`` when even an empty
        set of evictable models leaves too little, ``NoRoomNow`` when requests hold, or their
        grace keeps, the models that would have to go."""
        kept = self.kept_from(name, waited_s)
        return choose_victims(
            self.resident.values(), name, needed, self.limit, kept, self.popularity
        )

    def short_of(self, name: str, needed: int) -> bool:
        """Whether ``needed`` bytes (at most the limit) do not fit beside the other resident
        models while some of them could still be evicted once the requests holding them are
        answered (pinned ones never are)."""
        others = [r for r in self.resident.values() if r.name != name]
        free = self.limit - sum(r.bytes for r in others)
        return free < min(needed, self.limit) and any(not r.pinned for r in others)

    def idle_victims(self, name: str, needed: int) -> list[str]:
        """Like ``victims``, as far as idle models that are not pinned go: room for a load's
        passing peak, made where it can be without waiting (up to the whole limit)."""
        kept = self.kept_from(name)
        evictable = [r for r in self.resident.values() if not r.pinned and not kept(r.name)]
        free = self.limit - sum(r.bytes for r in self.resident.values() if r.name != name)
        chosen: list[str] = []
        for entry in sorted(evictable, key=eviction_order(self.popularity)):
            if free >= min(needed, self.limit):
                break
            if entry.name != name:
                chosen.append(entry.name)
                free += entry.bytes
        return chosen


def eviction_order(
    popularity: Callable[[str], float],
) -> Callable[[Resident], tuple[float, float, float]]:
    """The key that sorts resident models in the order they go: the least asked for first
    (``popularity``), then the least recently used, then the quickest to load again."""
    return lambda r: (popularity(r.name), r.last_used, r.load_seconds)


def choose_victims(
    resident: Iterable[Resident],
    name: str,
    needed: int,
    limit: int,
    held: Callable[[str], bool] = lambda _: False,
    popularity: Callable[[str], float] = lambda _: 0.0,
) -> list[str]:
    """The pure rule behind ``Residency.victims``; ``held``: whether a model may not go now (a
    request holds it, or its grace keeps it); ``popularity``: how much each model is asked for
    (``Residency.popularity``)."""
    others = [r for r in resident if r.name != name]
    pinned = sum(r.bytes for r in others if r.pinned)
    if needed + pinned > limit:
        beside = f" ({mib(pinned)} of it held by always-resident models)" if pinned else ""
        raise LargerThanLimit(
            f"model {name!r} needs {mib(needed)} of memory, more than the memory limit of "
            f"{mib(limit)}{beside} (NOGRAD_MEMORY_LIMIT_BYTES)"
        )
    free = limit - sum(r.bytes for r in others)
    chosen: list[str] = []
    waiting = 0
    for entry in sorted(others, key=eviction_order(popularity)):
        if free >= needed:
            break
        if entry.pinned:
            continue
        if held(entry.name):
            waiting += entry.bytes
            continue
        chosen.append(entry.name)
        free += entry.bytes
    if free < needed:
        raise NoRoomNow(
            f"model {name!r} needs {mib(needed)}; {mib(free)} of the memory limit of "
            f"{mib(limit)} can be freed now, {mib(waiting)} more once the other models in use "
            "are idle (requests in flight answered, and NOGRAD_EVICTION_GRACE_MS after their "
            "last request)"
        )
    return chosen
