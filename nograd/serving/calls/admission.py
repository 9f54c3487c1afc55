"""Admission: how much inference work one server process takes on before it refuses more.

The batcher's queue bound covers only requests that reached it. Under overload the backlog builds
before that: bodies being read, decoded and tokenised, all holding memory and event-loop time. So
every inference request counts from its headers to its answer, and one over the process's bound,
or bound for a model whose queue already holds more than it may wait (counting what the request
waited since its head arrived: a busy event loop's backlog), is refused at once, before its body
is read: a fast 503 with Retry-After costs the server almost nothing.

A count of requests does not bound their memory: 256 bodies of 64 MiB, or a few JSON bodies that
decode to ten times their size, would take gigabytes. So bodies also draw on a byte budget, from
their declared length (or chunk by chunk) and again by what decoding them is estimated to take,
until their request is answered; a request that does not fit is refused the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from nograd.batching import Batcher, WaitTooLong
from nograd.serving.errors import BodyBytesOverBudget, Overloaded


class Admission:
    """Counts the inference requests a process holds and refuses those over its bounds."""

    def __init__(
        self, max_in_flight: int, max_wait_s: float | None, max_bytes: int | None = None
    ) -> None:
        self.max_in_flight = max_in_flight
        self.max_wait_s = max_wait_s
        self.in_flight = 0
        self.max_bytes = max_bytes
        """The byte budget of bodies and their decoding; None: unbounded."""
        self.bytes_in_flight = 0

    def enter(self, batchers: Sequence[Batcher[Any, Any]] = (), waited_s: float = 0.0) -> None:
        """Take one request in, or raise (``Overloaded``, ``WaitTooLong``); each successful
        ``enter`` is matched by one ``leave``. ``batchers``: those of the models the request may
        be for (its path names one; an embeddings body, not read yet, any): it is refused when
        every one is over its wait bound. ``waited_s``: since the request's head arrived."""
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(
                f"server is overloaded: {self.in_flight} requests in flight, the most one "
                f"process holds (NOGRAD_MAX_REQUESTS_IN_FLIGHT); retry in 1 s"
            )
        if batchers and self.max_wait_s is not None:
            refusal: WaitTooLong | None = None
            now = time.monotonic()
            for batcher in batchers:
                try:
                    batcher.check_wait(now, None, self.max_wait_s, waited_s)
                except WaitTooLong as exc:
                    refusal = exc
                else:
                    refusal = None
                    break
            if refusal is not None:
                raise refusal
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    def take_bytes(self, size: int) -> None:
        """Draw ``size`` bytes from the budget, or raise ``BodyBytesOverBudget``; whatever is
        taken is given back with ``give_bytes`` once the request is answered."""
        if self.max_bytes is not None and self.bytes_in_flight + size > self.max_bytes:
            raise BodyBytesOverBudget(
                f"server is overloaded: request bodies and their decoding hold "
                f"{self.bytes_in_flight} bytes, {size} more would pass the limit of "
                f"{self.max_bytes} bytes one process holds (NOGRAD_MAX_BODY_BYTES_IN_FLIGHT); "
                "retry in 1 s"
            )
        self.bytes_in_flight += size

    def give_bytes(self, size: int) -> None:
        self.bytes_in_flight -= size
