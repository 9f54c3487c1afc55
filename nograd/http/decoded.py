"""The V2 inference calls a front process decoded, served by the engine process without ASGI.

The engine's one event loop runs every front's calls, and a small model's call spent most of
its time there in the layers around the serving core: the call's scope, its events and queue,
nograd's middlewares one inside the other, the request object, the watcher for its client. A
call its front decoded (``nograd.front.decoding``) needs none of them: it arrives as a
``DecodedCall`` and takes the same checks in the same order as the whole app would take it
through (the key, admission, the size limit and the byte budget, then the call's lifecycle),
each answered by the same function, so a client gets the same answer either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from nograd.bridge.frames import DecodedCall
from nograd.http import v2
from nograd.http.exchange import CallHead
from nograd.http.middleware import (
    BodyBudget,
    answer_unexpected,
    refuse_key,
    refuse_overloaded,
)
from nograd.protocol.v2_handover import Predecoded
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.errors import Forbidden, QueueFull, Unauthenticated

logger = logging.getLogger(__name__)

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class DecodedCalls:
    """Serves decoded calls (``nograd.bridge.host.DecodedApp``) over the serving core."""

    def __init__(self, calls: Calls, budget: BodyBudget) -> None:
        self._calls = calls
        self._budget = budget

    async def __call__(self, wire: tuple[Any, ...], send: Send, left: Callable[[], bool]) -> None:
        call = DecodedCall(*wire)
        try:
            await self._serve(call, send, left)
        except Exception:
            # As ``UnexpectedErrorMiddleware``: nothing is sent before the answer is whole.
            logger.exception("unhandled error on POST %s", call.path)
            await answer_unexpected(send, call.path)

    async def _serve(self, call: DecodedCall, send: Send, left: Callable[[], bool]) -> None:
        calls, path, name = self._calls, call.path, call.name
        started = time.perf_counter() if call.started is None else call.started
        if calls.keys_required:
            try:
                calls.authorize(list(call.authorization), "http", name, None)
            except (Unauthenticated, Forbidden) as exc:
                await refuse_key(send, path, exc)
                return
        try:
            calls.admit(name, started)
        except QueueFull as exc:
            await refuse_overloaded(send, path, exc)
            return
        try:
            budget = self._budget
            if call.length > budget.max_bytes:
                await budget.refuse_too_large(path, send)
                return
            if not await budget.took(path, send, call.length):
                return
            try:
                head = CallHead(path, call.request_id, started, call.timeout, call.trace_parent)
                predecoded = Predecoded.from_wire(call.request)
                reply = await v2.decoded_infer_call(
                    calls, head, name, call.version, predecoded, left
                )
                await reply.send(send)
            finally:
                budget.give(call.length)
        finally:
            calls.release()
