"""The socket hand-off: the port, the choice of worker, and a worker adopting sockets it is sent."""

from __future__ import annotations

import asyncio
import ctypes
import socket

import pytest

from nograd.supervisor.handoff import (
    HTTP,
    QUIET,
    Handoff,
    Inbox,
    bind_socket,
    least_loaded,
    send_connection,
)


def test_the_port_takes_no_connection_before_listening() -> None:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        sock.listen()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        sock.close()


def test_the_worker_with_fewest_open_connections_is_picked() -> None:
    assert least_loaded([5, 2, 7], last=1) == 1
    assert least_loaded([None, 9, 3], last=2) == 2
    assert least_loaded([None, None], last=0) is None
    assert least_loaded([], last=-1) is None


def test_ties_are_taken_in_turn_after_the_last_pick() -> None:
    picks, last = [], -1
    for _ in range(6):
        chosen = least_loaded([0, 0, 0], last)
        assert chosen is not None
        picks.append(chosen)
        last = chosen
    assert picks == [0, 1, 2, 0, 1, 2]
    assert least_loaded([1, None, 1], last=0) == 2


class Echo(asyncio.Protocol):
    """Answers its first read and closes, counting the close as a front's protocol does."""

    def __init__(self, closed: ctypes.c_longlong) -> None:
        self.closed = closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.value += 1


async def test_a_worker_serves_the_connections_it_is_sent_and_counts_those_it_closed() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setblocking(False)
    closed = ctypes.c_longlong(0)
    loop = asyncio.get_running_loop()
    inbox = Inbox(Handoff(theirs, closed), loop, {HTTP: lambda: Echo(closed)})
    inbox.open()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        for turn in range(3):
            client = socket.create_connection(listener.getsockname(), timeout=2)
            accepted, _ = listener.accept()
            with accepted:
                send_connection(ours, accepted)
            client.sendall(b"hello %d" % turn)
            reply = await loop.run_in_executor(None, client.recv, 64)
            assert reply == b"hello %d" % turn
            client.close()
        for _ in range(100):
            if closed.value == 3:
                break
            await asyncio.sleep(0.01)
        assert closed.value == 3
    finally:
        inbox.close()
        ours.close()
        listener.close()


async def test_a_draining_worker_reports_quiet_and_serves_what_was_sent_before_the_end() -> None:
    """At a stop: the worker's ``QUIET`` reaches the supervisor's end, a connection sent before
    the supervisor closed its end is still served, and the end is seen once it was read."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setblocking(False)
    closed = ctypes.c_longlong(0)
    loop = asyncio.get_running_loop()
    inbox = Inbox(Handoff(theirs, closed), loop, {HTTP: lambda: Echo(closed)})
    inbox.open()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        inbox.report_quiet()
        assert ours.recv(16) == QUIET
        assert not await inbox.wait_ended(0.05)
        client = socket.create_connection(listener.getsockname(), timeout=2)
        accepted, _ = listener.accept()
        with accepted:
            send_connection(ours, accepted)
        ours.close()  # the supervisor stopped accepting: nothing more will come
        assert await inbox.wait_ended(2)
        client.sendall(b"late")
        assert await loop.run_in_executor(None, client.recv, 64) == b"late"
        client.close()
    finally:
        inbox.close()
        listener.close()
