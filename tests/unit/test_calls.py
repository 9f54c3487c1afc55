"""``until_disconnect`` with a scripted ASGI ``receive``: who cancelled a call decides its end."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from app.api.calls import ClientGone, until_disconnect


def _request(disconnect: asyncio.Event, body: bytes = b"{}") -> Request:
    """A POST whose body arrives in two chunks; ``receive`` then blocks until ``disconnect``."""
    chunks: list[Message] = [
        {"type": "http.request", "body": body[:1], "more_body": True},
        {"type": "http.request", "body": body[1:], "more_body": False},
    ]

    async def receive() -> Message:
        if chunks:
            await asyncio.sleep(0)  # the body trickles in: the caller must suspend between chunks
            return chunks.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive)


async def test_work_sees_the_whole_body_and_its_answer_is_returned() -> None:
    request = _request(asyncio.Event(), b'{"a": 1}')

    async def work() -> Response:
        return Response(await request.body())

    response = await until_disconnect(request, work)
    assert response.body == b'{"a": 1}'


async def test_a_client_that_leaves_cancels_the_work_and_raises_client_gone() -> None:
    disconnect = asyncio.Event()
    request = _request(disconnect)
    reached: list[str] = []

    async def work() -> Response:
        reached.append("started")
        disconnect.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            reached.append("cancelled")
            raise
        return Response(b"too late")

    call = asyncio.create_task(until_disconnect(request, work))
    with pytest.raises(ClientGone):
        await asyncio.wait_for(call, 2)
    assert reached == ["started", "cancelled"]
    # The watcher's cancel request is withdrawn: the server's task goes on to answer 499.
    assert call.cancelling() == 0


async def test_a_cancel_from_elsewhere_still_propagates() -> None:
    """Server shutdown cancels the call's task: that is not a client leaving."""
    request = _request(asyncio.Event())
    started = asyncio.Event()

    async def work() -> Response:
        started.set()
        await asyncio.sleep(5)
        return Response(b"never")

    call = asyncio.create_task(until_disconnect(request, work))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
