"""The ASGI side of an inference call with a scripted ``receive``: the body read once, headers
decoded once, and who cancelled a call deciding its end."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from nograd.http.exchange import ClientGone, Incoming, run_call, until_disconnect
from nograd.http.reply import Reply
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.serving.calls.lifecycle import CLIENT_GONE, Call, Calls
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings


def _incoming(
    disconnect: asyncio.Event, body: bytes = b"{}", headers: list[tuple[bytes, bytes]] | None = None
) -> Incoming:
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

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers or []}
    return Incoming(scope, receive)


async def test_the_body_is_joined_from_its_chunks_and_read_once() -> None:
    incoming = _incoming(asyncio.Event(), b'{"a": 1}')
    assert await incoming.body() == b'{"a": 1}'
    assert await incoming.body() == b'{"a": 1}'  # a second read does not reach ``receive``


async def test_a_client_that_leaves_before_its_body_ends_is_gone() -> None:
    async def receive() -> Message:
        return {"type": "http.disconnect"}

    incoming = Incoming({"type": "http", "headers": []}, receive)
    with pytest.raises(ClientGone):
        await incoming.body()


def test_headers_are_decoded_once_and_the_first_of_a_repeated_name_wins() -> None:
    headers = [(b"x-request-id", b"first"), (b"content-type", b"a/b"), (b"x-request-id", b"2nd")]
    incoming = _incoming(asyncio.Event(), headers=headers)
    assert incoming.headers == {"x-request-id": "first", "content-type": "a/b"}


async def test_a_reply_goes_out_as_two_asgi_messages_with_lower_case_headers() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await Reply(503, b'{"error": "x"}', headers=[("Retry-After", "1")]).send(send)
    assert sent == [
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-length", b"14"),
                (b"content-type", b"application/json"),
                (b"retry-after", b"1"),
            ],
        },
        {"type": "http.response.body", "body": b'{"error": "x"}'},
    ]
    response = Reply(200, b"raw", "application/octet-stream", [("A-B", "c")]).response()
    assert (response.status_code, response.body) == (200, b"raw")
    assert response.headers["a-b"] == "c"
    assert response.headers["content-type"] == "application/octet-stream"


async def test_work_runs_and_its_answer_is_returned() -> None:
    incoming = _incoming(asyncio.Event(), b'{"a": 1}')
    body = await incoming.body()

    async def work() -> Reply:
        return Reply(200, body)

    reply = await until_disconnect(incoming.receive, work)
    assert reply.body == b'{"a": 1}'


@pytest.mark.parametrize("grace_s", [0.0, 0.02])
async def test_a_client_that_leaves_cancels_the_work_and_raises_client_gone(
    grace_s: float,
) -> None:
    disconnect = asyncio.Event()
    incoming = _incoming(disconnect)
    await incoming.body()
    reached: list[str] = []

    async def work() -> Reply:
        reached.append("started")
        disconnect.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            reached.append("cancelled")
            raise
        return Reply(200, b"too late")

    call = asyncio.create_task(until_disconnect(incoming.receive, work, grace_s))
    with pytest.raises(ClientGone):
        await asyncio.wait_for(call, 2)
    assert reached == ["started", "cancelled"]
    # The watcher's cancel request is withdrawn: the server's task goes on to answer 499.
    assert call.cancelling() == 0


async def test_no_watcher_reads_receive_for_a_call_answered_within_the_grace() -> None:
    """The watcher task, the costly part, starts only for calls that outlive the grace."""
    reads: list[str] = []

    async def receive() -> Message:
        reads.append("receive")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def quick() -> Reply:
        await asyncio.sleep(0.001)
        return Reply(200, b"ok")

    assert (await until_disconnect(receive, quick, 0.5)).body == b"ok"
    assert reads == []

    async def slow() -> Reply:
        await asyncio.sleep(0.1)
        return Reply(200, b"late")

    assert (await until_disconnect(receive, slow, 0.02)).body == b"late"
    assert reads == ["receive"]


async def test_a_cancel_from_elsewhere_still_propagates() -> None:
    """Server shutdown cancels the call's task: that is not a client leaving."""
    incoming = _incoming(asyncio.Event())
    await incoming.body()
    started = asyncio.Event()

    async def work() -> Reply:
        started.set()
        await asyncio.sleep(5)
        return Reply(200, b"never")

    call = asyncio.create_task(until_disconnect(incoming.receive, work))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_client_gone_mid_body_is_counted_499_and_no_work_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not a 500 with a traceback in the log: nothing failed but the connection."""
    sent: list[Message] = [{"type": "http.request", "body": b'{"in', "more_body": True}]

    async def receive() -> Message:
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    metrics = Metrics()
    ran: list[Call] = []

    async def work(call: Call) -> Reply:
        ran.append(call)
        return Reply(200)

    def on_error(status: int, exc: Exception) -> Reply:
        raise AssertionError(f"no error reply expected, got {status}: {exc}")

    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": []}
    calls = Calls(DataPlane(Settings(), metrics), metrics, ())
    reply = await run_call(Incoming(scope, receive), calls, "v2", work, on_error)
    assert reply.status == CLIENT_GONE and ran == []
    assert reply.headers[-1][0] == "X-Request-ID"
    assert (
        metrics.registry.get_sample_value(
            "nograd_requests_total", {"model": UNKNOWN_MODEL, "protocol": "v2", "code": "499"}
        )
        == 1
    )
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
