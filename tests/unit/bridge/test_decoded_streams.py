"""The engine's end of a decoded call (``DECODED``): served by the decoded app, not the ASGI
app; its answer ends its stream; its client leaving cancels it, and a client that leaves
before it ever ran only marks it, so its stream is still cleaned up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from nograd.bridge.frames import ABORT, ANSWER, DECODED, frame
from nograd.bridge.host import DISCONNECT, FrontConnection
from tests.unit.bridge.recording import Transport

Event = MutableMapping[str, Any]
CALL = ("/v2/models/m/infer", "m", None, 1.0, None, None, None, (), 2, ())


async def never_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a decoded call never reaches the ASGI app")


def connection(
    decoded: Callable[[tuple[Any, ...], Any, Callable[[], bool]], Awaitable[None]],
) -> tuple[FrontConnection, Transport]:
    transport = Transport()
    front = FrontConnection(never_app, decoded, set())
    front.connection_made(transport)  # type: ignore[arg-type]
    return front, transport


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_answer_ends_its_stream_without_an_abort() -> None:
    seen: list[tuple[Any, ...]] = []

    async def decoded(call: tuple[Any, ...], send: Any, left: Callable[[], bool]) -> None:
        seen.append(call)
        await send({"type": ANSWER, "answer": (), "headers": []})

    front, transport = connection(decoded)
    front.data_received(frame(3, (DECODED, CALL)))
    await settle()
    assert seen == [CALL]
    assert transport.frames() == [(3, {"type": ANSWER, "answer": (), "headers": []})]
    assert front.streams == {}


async def test_a_client_that_leaves_cancels_its_call() -> None:
    cancelled: list[bool] = []

    async def decoded(call: tuple[Any, ...], send: Any, left: Callable[[], bool]) -> None:
        try:
            await asyncio.Event().wait()  # queued behind a long batch
        except asyncio.CancelledError:
            cancelled.append(left())
            raise

    front, transport = connection(decoded)
    front.data_received(frame(5, (DECODED, CALL)))
    await settle()
    assert 5 in front.streams
    front.data_received(frame(5, DISCONNECT))
    await settle()
    assert cancelled == [True]  # the call learns it was its client that left
    assert front.streams == {}
    assert transport.frames() == [(5, ABORT)]  # nothing answered: the front closes the stream


async def test_a_client_gone_before_its_call_ran_still_frees_its_stream() -> None:
    ran: list[bool] = []

    async def decoded(call: tuple[Any, ...], send: Any, left: Callable[[], bool]) -> None:
        ran.append(left())
        await send({"type": ANSWER, "answer": (), "headers": []})

    front, _ = connection(decoded)
    # Both frames in one read: the disconnect comes before the call's task ever ran.
    front.data_received(frame(7, (DECODED, CALL)) + frame(7, DISCONNECT))
    await settle()
    assert ran == [True]
    assert front.streams == {}


async def test_a_front_that_loses_the_engine_cuts_its_decoded_calls() -> None:
    async def decoded(call: tuple[Any, ...], send: Any, left: Callable[[], bool]) -> None:
        await asyncio.Event().wait()

    front, _ = connection(decoded)
    front.data_received(frame(1, (DECODED, CALL)) + frame(2, (DECODED, CALL)))
    await settle()
    front.connection_lost(None)
    await settle()
    assert front.streams == {}


async def test_an_engine_without_decoded_calls_cuts_one() -> None:
    transport = Transport()
    front = FrontConnection(never_app, None, set())
    front.connection_made(transport)  # type: ignore[arg-type]
    front.data_received(frame(9, (DECODED, CALL)))
    await settle()
    assert transport.frames() == [(9, ABORT)]
    assert front.streams == {}
