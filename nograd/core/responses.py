"""The responses a decoupled model sends for one request, carried from whichever thread sends
them to the event loop whose front streams them out (Triton's decoupled transaction policy)."""

from __future__ import annotations

import asyncio
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
    """Responses put from any thread (the model's), taken in order on the loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Response] = asyncio.Queue()

    def put(self, response: Response) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, response)

    async def responses(self) -> AsyncIterator[Response]:
        """Every response until the final one (that one included)."""
        while True:
            response = await self._queue.get()
            yield response
            if response.final:
                return
