"""The socket hand-off between the supervisor and its worker processes, both ends.

The supervisor accepts every connection and passes the socket to the worker with the fewest open
connections over a Unix SOCK_SEQPACKET pair (one message per connection); the worker adopts it
into its event loop as if it had accepted it. Letting the kernel spread connections instead (one
shared listening socket, or one ``SO_REUSEPORT`` socket per worker) left one worker with most of
a client's connections (docs/architecture.md). Each worker counts the connections it closed in a
shared counter, so the supervisor knows how many each has open.

At a stop the channel carries the one message a worker sends back, ``QUIET`` (it holds no request
and would exit), and the supervisor ends each channel once it stopped accepting, so a worker
exits only when no hand-off can still reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

QUIET = b"q"
"""A draining worker's word to its supervisor: it holds no request."""


@dataclass(frozen=True)
class Handoff:
    """A worker's end of the way connections reach it from the supervisor."""

    channel: socket.socket
    """Unix SOCK_SEQPACKET socket: one message per connection, the socket passed along."""
    closed: ctypes.c_longlong
    """Shared with the supervisor: connections this worker has closed so far."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The port, bound and not yet listening: until ``listen`` (once the workers are warm) the
    kernel refuses connections rather than queueing them for a server that cannot answer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def least_loaded(open_connections: Sequence[int | None], last: int) -> int | None:
    """The worker to hand the next connection: fewest open connections, ties taken in turn
    after ``last`` (so one-request connections alternate); None marks a worker not serving."""
    count = len(open_connections)
    best: int | None = None
    best_load = 0
    for step in range(1, count + 1):
        index = (last + step) % count
        load = open_connections[index]
        if load is not None and (best is None or load < best_load):
            best, best_load = index, load
    return best


def send_connection(channel: socket.socket, conn: socket.socket) -> None:
    """Pass ``conn`` to the worker at the other end of ``channel`` (raises what ``sendmsg`` does:
    BlockingIOError when its inbox is full, OSError when its end is closed)."""
    socket.send_fds(channel, [b"c"], [conn.fileno()])


def counting(base: type[asyncio.Protocol], closed: ctypes.c_longlong) -> type[asyncio.Protocol]:
    """``base`` that counts its closed connections in ``closed``, for the supervisor."""

    def connection_lost(self: asyncio.Protocol, exc: Exception | None) -> None:
        try:
            base.connection_lost(self, exc)
        finally:
            closed.value += 1

    return type(f"Counted{base.__name__}", (base,), {"connection_lost": connection_lost})


class Inbox:
    """The worker's end: takes each connection the supervisor sends and serves it on ``loop``
    with a protocol from ``create_protocol``, like a connection the worker accepted itself."""

    def __init__(
        self,
        handoff: Handoff,
        loop: asyncio.AbstractEventLoop,
        create_protocol: Callable[[], asyncio.Protocol],
    ) -> None:
        self._handoff = handoff
        self._loop = loop
        self._create_protocol = create_protocol
        self._adopting: set[asyncio.Task[None]] = set()
        self._ended = asyncio.Event()

    @property
    def adopting(self) -> bool:
        """Connections received and not yet served (their protocol not made yet)."""
        return bool(self._adopting)

    def report_quiet(self) -> None:
        """Tell the supervisor this draining worker holds no request (``QUIET``)."""
        with contextlib.suppress(OSError):  # the supervisor is gone: nothing waits for it
            self._handoff.channel.send(QUIET)

    async def wait_ended(self, timeout_s: float) -> bool:
        """Wait until the supervisor has handed over its last connection (its end closed), or
        ``timeout_s`` passed (False)."""
        try:
            await asyncio.wait_for(self._ended.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def open(self) -> None:
        self._loop.add_reader(self._handoff.channel.fileno(), self._receive)

    def close(self) -> None:
        """No new connections from here on; the supervisor hands them to the other workers."""
        with contextlib.suppress(ValueError, OSError):  # already closed
            self._loop.remove_reader(self._handoff.channel.fileno())
        self._handoff.channel.close()
        self._ended.set()

    def _receive(self) -> None:
        """Take every connection waiting in the channel and serve each like an accepted one."""
        channel = self._handoff.channel
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(channel, 1, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message, fds = b"", []
            if not message and not fds:  # the supervisor's end closed: nothing more will come
                self._loop.remove_reader(channel.fileno())
                self._ended.set()
                return
            for fd in fds:
                task = self._loop.create_task(self._adopt(socket.socket(fileno=fd)))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._create_protocol, conn)
        except OSError as exc:  # the client left before it could be served
            logger.debug("a handed-over connection failed: %s", exc)
            conn.close()
            self._handoff.closed.value += 1
