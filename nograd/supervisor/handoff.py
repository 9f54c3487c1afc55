"""The socket hand-off between the supervisor and its worker processes, both ends.

The supervisor accepts every connection and passes the socket to the worker with the fewest open
connections over a Unix SOCK_SEQPACKET pair (one message per connection); the worker adopts it
into its event loop as if it had accepted it. Letting the kernel spread connections instead (one
shared listening socket, or one ``SO_REUSEPORT`` socket per worker) left one worker with most of
a client's connections (docs/architecture.md). Each worker counts the connections it closed in a
shared counter, so the supervisor knows how many each has open. Each message names the front
the connection is for (``HTTP`` or ``GRPC``): the supervisor listens on both ports.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nograd.settings import Settings

logger = logging.getLogger(__name__)

QUIET = b"q"
"""A draining worker's word to its supervisor: it holds no request."""
HTTP = b"h"
GRPC = b"g"
"""What a handed-over connection speaks: the front that serves it."""


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


def bind_ports(settings: Settings) -> dict[bytes, socket.socket]:
    """The HTTP and gRPC ports (those not turned off), bound before any worker starts, so a taken
    one fails the start at once, naming its setting."""
    bound: dict[bytes, socket.socket] = {}
    for front, port, name in (
        (HTTP, settings.port, "NOGRAD_PORT"),
        (GRPC, settings.grpc_port, "NOGRAD_GRPC_PORT"),
    ):
        if not port:
            continue
        try:
            bound[front] = bind_socket(settings.host, port)
        except OSError as exc:
            for sock in bound.values():
                sock.close()
            raise OSError(
                f"cannot listen on {settings.host}:{port} ({name}): {exc.strerror}"
            ) from exc
    return bound


def describe_ports(sockets: Mapping[bytes, socket.socket]) -> str:
    """``HTTP 8000, gRPC 8001``: the ports and what each serves, for the log."""
    names = {HTTP: "HTTP", GRPC: "gRPC"}
    return ", ".join(f"{names[front]} {sock.getsockname()[1]}" for front, sock in sockets.items())


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


def send_connection(channel: socket.socket, conn: socket.socket, front: bytes = HTTP) -> None:
    """Pass ``conn`` for ``front`` to the worker at the other end of ``channel`` (raises what
    ``sendmsg`` does: BlockingIOError when its inbox is full, OSError when its end is closed)."""
    socket.send_fds(channel, [front], [conn.fileno()])


class Inbox:
    """The worker's end: takes each connection the supervisor sends and serves it on ``loop``
    with a protocol from the factory of its front, like a connection the worker accepted itself.
    The protocols count their own closes (``Handoff.closed``); the inbox counts those it could not
    serve."""

    def __init__(
        self,
        handoff: Handoff,
        loop: asyncio.AbstractEventLoop,
        factories: Mapping[bytes, Callable[[], asyncio.Protocol]],
    ) -> None:
        self._handoff = handoff
        self._loop = loop
        self._factories = factories
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
            factory = self._factories.get(message)
            for fd in fds:
                conn = socket.socket(fileno=fd)
                if factory is None:  # a front this worker does not serve
                    conn.close()
                    self._handoff.closed.value += 1
                    continue
                task = self._loop.create_task(self._adopt(conn, factory))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        try:
            await self._loop.connect_accepted_socket(factory, conn)
        except OSError as exc:  # the client left before it could be served
            logger.debug("a handed-over connection failed: %s", exc)
            conn.close()
            self._handoff.closed.value += 1
