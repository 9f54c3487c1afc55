"""The responses a decoupled model sends for one request, carried from whichever thread sends
them to the event loop whose front streams them out (Triton's decoupled transaction policy).

The queue between them is bounded: a model sending faster than its client takes the responses
waits in its ``send`` (its own thread, never the event loop) until there is room, so a client
that reads nothing holds a few responses, not every one the model makes. Once the call has
ended (answered, its client gone, its stream reset) a send returns at once and its response is
dropped, so a waiting model goes on.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Response:
    """One response: its outputs, or the model's error for it; ``final``: the last one."""

    outputs: Mapping[str, Any] | None
    error: BaseException | None
    final: bool


class ResponseQueue:
    """Responses put from any thread (the model's), taken in order on the loop that made it; at
    most ``max_size`` wait at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_size: int = 64) -> None:
        self._loop = loop
        self._max_size = max_size
        self._items: deque[Response] = deque()
        self._room = threading.Condition()
        self._arrived = asyncio.Event()
        self._ended = False

    def put(self, response: Response) -> None:
        """Queue ``response``, waiting while ``max_size`` are queued; dropped once the call has
        ended. On the loop's own thread (a model's coroutine run there) it never waits."""
        on_loop = _running_loop() is self._loop
        with self._room:
            while len(self._items) >= self._max_size and not self._ended and not on_loop:
                self._room.wait()
            if self._ended:
                return
            self._items.append(response)
        if on_loop:
            self._arrived.set()
        else:
            self._loop.call_soon_threadsafe(self._arrived.set)

    def end(self) -> None:
        """The call has ended: what waits is dropped, and every sender goes on at once."""
        with self._room:
            self._ended = True
            self._items.clear()
            self._room.notify_all()

    @property
    def queued(self) -> int:
        return len(self._items)

    async def responses(self) -> AsyncIterator[Response]:
        """Every response until the final one (that one included); the queue ends with the
        iteration, however it ends."""
        try:
            while True:
                with self._room:
                    response = self._items.popleft() if self._items else None
                    if response is not None:
                        self._room.notify()
                    else:
                        self._arrived.clear()
                if response is None:
                    await self._arrived.wait()
                    continue
                yield response
                if response.final:
                    return
        finally:
            self.end()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
