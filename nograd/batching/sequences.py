"""The sequences of one sequence model under way (Triton's sequence batcher): each one's requests
run one at a time, in the order they came, on the state the previous one left; requests of
different sequences run concurrently, so the model's batcher batches them together. A sequence
that receives no request for the idle time is released, as is one whose last request ended it.

Nothing here knows tensors: a sequence's state is whatever its caller keeps in ``state``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from nograd.batching.errors import BatchingError, QueueFull

T = TypeVar("T")


class UnknownSequence(BatchingError):
    """A request continues a sequence that was never started, ended, or was released idle."""


class TooManySequences(QueueFull):
    """Every place for a sequence is taken by one under way: shed the new one rather than grow
    memory."""

    reason = "sequences_full"


class Sequence:
    """One sequence under way: its order of turns and the state its requests carry over."""

    __slots__ = ("busy", "last_used", "state", "turn")

    def __init__(self, now: float) -> None:
        self.turn = asyncio.Lock()
        """Held by the request running; asyncio's lock wakes waiters in the order they came."""
        self.state: dict[str, Any] = {}
        self.last_used = now
        self.busy = 0
        """Requests of this sequence admitted and not answered yet."""


class Place:
    """A request's place among the requests of its sequence, taken as it arrives: it reaches
    its sequence only after those that took a place before it (a stream's requests are decoded
    concurrently, and a large one would otherwise be overtaken)."""

    __slots__ = ("book", "key", "left", "reached")

    def __init__(self, book: SequenceBook, key: Hashable) -> None:
        self.book = book
        self.key = key
        self.reached = asyncio.Event()
        """Set once every place taken before this one has left."""
        self.left = False

    def leave(self) -> None:
        """Give the place up (the request reached its sequence, or failed before): the next
        one may go on. Idempotent."""
        self.book._leave(self)

    def left_with(self, _: object) -> None:
        """``leave`` as a done callback of the task serving the request."""
        self.leave()


class SequenceBook:
    """The sequences of one model by id (an int and a string id are different sequences)."""

    def __init__(
        self,
        idle_s: float,
        max_sequences: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.max_sequences = max_sequences
        self._clock = clock
        self._sequences: OrderedDict[Hashable, Sequence] = OrderedDict()
        """Least recently used first, so the idle ones are found at the front."""
        self._places: dict[Hashable, deque[Place]] = {}
        """The places taken by requests on their way to each sequence, in arrival order."""

    def __len__(self) -> int:
        self.release_idle()
        return len(self._sequences)

    def __contains__(self, key: Hashable) -> bool:
        self.release_idle()
        return key in self._sequences

    @property
    def held(self) -> int:
        """Sequences held now, idle ones not yet released included."""
        return len(self._sequences)

    @property
    def empty(self) -> bool:
        """No sequence held and no request on its way to one."""
        return not self._sequences and not self._places

    def release_idle(self) -> int:
        """Release every sequence idle for longer than ``idle_s``; how many were."""
        now = self._clock()
        released = 0
        for _ in range(len(self._sequences)):
            key, sequence = next(iter(self._sequences.items()))
            if now - sequence.last_used <= self.idle_s:
                break
            if sequence.busy:
                self._sequences.move_to_end(key)  # waiting on its model is not idling
                continue
            del self._sequences[key]
            released += 1
        return released

    def take_place(self, key: Hashable) -> Place:
        """A place for a request of sequence ``key``, behind the places taken before it."""
        place = Place(self, key)
        waiting = self._places.setdefault(key, deque())
        waiting.append(place)
        if len(waiting) == 1:
            place.reached.set()
        return place

    def _leave(self, place: Place) -> None:
        if place.left:
            return
        place.left = True
        waiting = self._places[place.key]
        first = waiting[0] is place
        waiting.remove(place)
        if not waiting:
            del self._places[place.key]
        elif first:
            waiting[0].reached.set()

    async def run(
        self,
        key: Hashable,
        start: bool,
        end: bool,
        work: Callable[[Sequence], Awaitable[T]],
        place: Place | None = None,
    ) -> T:
        """Run ``work`` as the next request of sequence ``key``, after the requests of it that
        came before (with a ``place``: after those that took one before it). ``start`` begins
        the sequence afresh (one under way with that id is released); without it the sequence
        must be under way (``UnknownSequence``). ``end`` releases it once answered, so its id
        may start a new one."""
        if place is not None and place.book is self and place.key == key and not place.left:
            try:
                await place.reached.wait()
                sequence = self._enter(key, start)
            finally:
                place.leave()
        else:
            sequence = self._enter(key, start)
        try:
            async with sequence.turn:
                return await work(sequence)
        finally:
            sequence.busy -= 1
            sequence.last_used = self._clock()
            if end and self._sequences.get(key) is sequence:
                del self._sequences[key]

    def _enter(self, key: Hashable, start: bool) -> Sequence:
        self.release_idle()
        now = self._clock()
        sequence = self._sequences.get(key)
        if start:
            if sequence is None and len(self._sequences) >= self.max_sequences:
                raise TooManySequences(
                    f"{len(self._sequences)} sequences are under way, the most this model "
                    f"keeps (NOGRAD_MAX_SEQUENCES); each is released by its end or after "
                    f"{self.idle_s:g} s idle",
                    retry_after_s=self.idle_s,
                )
            sequence = Sequence(now)
            self._sequences[key] = sequence
        elif sequence is None:
            raise UnknownSequence(key)
        self._sequences.move_to_end(key)
        sequence.last_used = now
        sequence.busy += 1
        return sequence
