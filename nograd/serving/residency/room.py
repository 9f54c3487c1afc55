"""Making room in the resident set for what a load (or a profile) brings in.

Models are evicted least recently used first (``Residency.victims``); one a request holds, or
one kept by its grace, is waited for within a bound, then the request is refused with 503 and
Retry-After. A grace is waited out differently by a load alone and by one other loads queue
behind: alone, it waits for a grace to end (the model that goes is then one no longer asked for)
and takes the least asked for graced model only as its bound ends; with loads behind it, every
second it waits stalls them too, so it takes that model after a few of its loads
(``GRACE_WAIT_LOADS``). A load's passing height (the files read and the sessions built beside
what the model keeps) only evicts idle models, and waits for held ones only while they can finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection

from nograd.serving.errors import NoRoomNow
from nograd.serving.residency.policy import Residency

ROOM_WAIT_S = 2.0
"""How long a load waits for requests on the models it must evict, when the server sets no
queue-wait bound; then the request is refused with 503 and Retry-After."""
LAST_LOOK_S = 0.1
"""How long before its bound a load alone takes a model only a grace keeps, rather than be
refused: a grace is a preference, a request's hold is not."""


class RoomForLoads:
    """Evicts for a model coming in, waiting within ``wait_s`` for the requests holding the
    models that must go; ``evict`` unloads one (False when a request took hold of it)."""

    def __init__(
        self,
        residency: Residency,
        wait_s: float | None,
        waiting: Counter[str],
        loading: Collection[str],
        evict: Callable[[str, str], Awaitable[bool]],
    ) -> None:
        self._residency = residency
        self._room_wait_s = wait_s or ROOM_WAIT_S
        self._waiting = waiting
        """Holds of the requests waiting for a load, per model (the on-demand control's)."""
        self._loading = loading
        """The models whose load is under way or waiting its turn (the on-demand control's)."""
        self._evict = evict
        self._changed = asyncio.Event()
        """Set when a load waiting for room should look again."""

    def look_again(self) -> None:
        """The last request holding a model was answered, or another load queued: a load
        waiting for room looks again."""
        self._changed.set()

    async def make_room(self, name: str, needed: int) -> None:
        """Evict until ``needed`` bytes fit for ``name``, waiting (within the wait bound) for
        requests on the models that must go and for their grace to pass; ``LargerThanLimit``
        or ``NoRoomNow`` else."""
        started = time.monotonic()
        deadline = started + self._room_wait_s
        while True:
            now = time.monotonic()
            alone = not any(other != name for other in self._loading)
            if not alone:
                waited = now - started
            else:  # it outwaits no grace until its last look, then every one
                waited = math.inf if deadline - now <= LAST_LOOK_S else -math.inf
            try:
                victims = self._residency.victims(name, needed, waited)
            except NoRoomNow:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                last_look = remaining - LAST_LOOK_S
                await self._wait_for_room(
                    name, last_look if alone and last_look > 0 else remaining, waited
                )
                continue
            evicted = [await self._evict(victim, "memory") for victim in victims]
            if all(evicted):
                return

    async def room_for_height(self, name: str, height: int) -> None:
        """Make room for the height a load of ``name`` rises to (it reads the files and builds
        sessions beside what the model keeps): idle models are evicted, and models requests
        hold are waited for (within the wait bound) until they are idle too; then the load
        goes on whatever is left, since only what it keeps must fit."""
        deadline = time.monotonic() + self._room_wait_s
        while True:
            for victim in self._residency.idle_victims(name, height):
                await self._evict(victim, "memory")
            remaining = deadline - time.monotonic()
            if not self._residency.short_of(name, height) or remaining <= 0:
                return
            if self._residency.grace_s > 0 or not self._releasable(name):
                # A model answered is kept by its grace: not waited for, for a passing peak.
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def _wait_for_room(self, name: str, longest_s: float, waited_s: float) -> None:
        """Wait, at most ``longest_s``, until a request on another model is answered or the
        grace that keeps another model (besides ``name``) from eviction ends for a load that
        has waited ``waited_s``."""
        grace = self._residency.grace_ends_in(name, waited_s)
        wait_s = longest_s if grace is None else min(longest_s, grace + 0.001)
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), wait_s)

    def _releasable(self, name: str) -> bool:
        """Whether a resident model besides ``name`` is held by a request that can finish
        without a load: an ensemble's request waiting for its next step holds its other steps
        until that load is done, so a load never waits for them."""
        return any(
            self._residency.holds.get(r.name, 0) > self._waiting[r.name]
            for r in self._residency.resident.values()
            if r.name != name and not r.pinned
        )
