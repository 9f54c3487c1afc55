"""Guarding connections: slow or oversized requests cut off, and a cap on open connections.

uvicorn waits as long as a client likes for a request's headers and body and parses a head of
any size, so a few hundred slow clients (slowloris) could hold every connection a server has.
The guard is uvicorn's httptools protocol with limits added: a request's head must arrive within
``header_timeout_s`` (else 408), a body may pause at most ``body_timeout_s`` between two pieces
(else 408), a head over ``max_header_bytes`` gets 431, and a connection beyond
``max_connections`` gets 503 at once, before any request is read; each refusal closes the
connection. Timers are loop callbacks, never a task per connection, and most requests arm none:
one whose head or body arrives in a single read is done before any timer is needed.

Once the server drains, every response ends its connection (``Connection: close``), so no client
sends another request on a connection about to close; a connection kept alive between requests
when the drain began stays open until its next request (answered, and the connection ended) or
its keep-alive timeout, as it would without a stop: closing it earlier would cut a request its
client may be sending at that moment.

A response's head and body, which uvicorn writes apart, leave in one write (``JoinedWrites``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from nograd.http.error_bodies import error_body
from nograd.serving.errors import RETRY_AFTER_S
from nograd.settings import Settings

STARTED_KEY: Final = "nograd_started"
"""Where a request's arrival time (``time.perf_counter``) is kept in its scope's state."""

logger = logging.getLogger(__name__)

HEADER_TIMEOUT: Final = "header_timeout"
BODY_TIMEOUT: Final = "body_timeout"
HEADER_TOO_LARGE: Final = "header_too_large"
TOO_MANY_CONNECTIONS: Final = "too_many_connections"
"""The ``reason`` labels of the refusals in ``nograd_rejected_total``."""

JOIN_LIMIT_BYTES: Final = 64 * 1024
"""Writes up to this size wait for the end of the event loop's turn to leave with the others of
that turn; a larger one leaves at once (joining it would copy it)."""

FILE_HEADROOM: Final = 256
"""Open files a process needs besides its connections (models, libraries, logs, pipes)."""

Headers = Sequence[tuple[bytes, bytes]]


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_connections=settings.max_connections,
        )


@dataclass
class ConnectionGuard:
    """What a guarded protocol class enforces, whom it tells of each refusal, and whether the
    server drains."""

    limits: ConnectionLimits
    on_refusal: Callable[[str], None]
    """Called with the reason of each refusal (one of the labels above), for the metric."""
    draining: bool = False
    """Set once at a stop: from then on every response ends its connection."""


def refusal(status: int, message: str, default_headers: Headers, extra: Headers = ()) -> bytes:
    """A whole response that ends the connection, written straight to the socket: these
    refusals happen outside any request the app could answer."""
    body = error_body(message)
    parts = [STATUS_LINE[status]]
    for name, value in (*default_headers, *extra):
        parts += [name, b": ", value, b"\r\n"]
    parts += [
        b"content-type: application/json\r\ncontent-length: ",
        str(len(body)).encode(),
        b"\r\nconnection: close\r\n\r\n",
        body,
    ]
    return b"".join(parts)


def head_size(method: bytes, target: bytes, headers: Headers) -> int:
    """Bytes of a request line and its headers as sent (``METHOD target HTTP/1.1`` and
    ``name: value`` lines)."""
    request_line = len(method) + 1 + len(target) + len(" HTTP/1.1\r\n")
    return request_line + sum(len(name) + len(value) + 4 for name, value in headers) + 2


async def _head_too_large(scope: Any, receive: Any, send: Any) -> None:
    """Answers in the app's place a request whose head turned out too large once complete (the
    parser is mid-read then, so the response must go through uvicorn's request cycle)."""
    del scope, receive
    body = error_body("request headers too large")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 431, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class JoinedWrites:
    """A connection's transport whose small writes of one event-loop turn leave in one system
    call: uvicorn writes a response's head and its body apart, two sends and two packets for
    each of the small answers a model server mostly gives."""

    __slots__ = ("_loop", "_pending", "_pending_bytes", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None
        self._pending_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        size = len(data)
        if size > JOIN_LIMIT_BYTES or self._pending_bytes + size > JOIN_LIMIT_BYTES:
            self.flush()
            self._transport.write(data)
            return
        if self._pending is None:
            self._pending = []
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))
        self._pending_bytes += size

    def flush(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        self._pending_bytes = 0
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._pending_bytes = 0
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of ``guard`` (a class attribute, set by
    :func:`guarded_protocol`, since uvicorn builds protocols from a class alone).

    A request's life: its head is read (``_reading_head``: bytes counted, the head timer
    running from its first byte), then its body (the body timer checking the pauses), then
    the next request's head; a message completing mid-read leaves the rest of that read
    uncounted (``_unmeasured``), so the head after it is measured exactly once complete.
    """

    guard: ClassVar[ConnectionGuard]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = self.guard.limits
        self._on_refusal = self.guard.on_refusal
        self._header_timeout_s = limits.header_timeout_s
        self._body_timeout_s = limits.body_timeout_s
        self._max_header_bytes = limits.max_header_bytes
        self._max_connections = limits.max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started_at: float | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._last_read_at = 0.0
        self._reading_head = True
        self._head_bytes = 0
        self._unmeasured = 0
        self._read_size = 0
        self._refused = False
        self._heads_read = 0

    @property
    def expecting_request(self) -> bool:
        """A request may be on its way and no app holds it yet: part of its head arrived, the
        connection is new (clients open one to send a request; its bytes may be unread), or it
        is kept alive between requests (its client may send the next one until the keep-alive
        timeout closes it)."""
        if self._refused or self.transport is None or self.transport.is_closing():
            return False
        return self._reading_head

    def begin_drain(self) -> None:
        """The response under way, if any, ends this connection (``Connection: close``)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._max_connections:
            # Not added to the server's connections: uvicorn has nothing to wait for.
            self.transport = transport
            extra = [(b"retry-after", str(RETRY_AFTER_S).encode())]
            message = "too many connections; retry later"
            transport.write(refusal(503, message, self.server_state.default_headers, extra))
            transport.close()
            self._on_refusal(TOO_MANY_CONNECTIONS)
            logger.debug("connection refused: %d already open", len(self.connections))
            return
        super().connection_made(JoinedWrites(transport, self.loop))  # type: ignore[arg-type]
        self._head_started_at = self.loop.time()
        self._head_timer = self.loop.call_later(self._header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        size = len(data)
        if self._reading_head:
            self._head_bytes += size
        else:
            self._last_read_at = self.loop.time()
        self._read_size = size
        super().data_received(data)
        if self._reading_head:
            # Every byte counted arrived while this head was incomplete: a lower bound of it.
            if self._head_bytes > self._max_header_bytes:
                self._refuse(431, HEADER_TOO_LARGE, "request headers too large")
            elif self._head_timer is None and self._head_started_at is not None:
                deadline = self._head_started_at + self._header_timeout_s
                self._head_timer = self.loop.call_at(deadline, self._head_timed_out)
        elif self._body_timer is None:
            self._last_read_at = self.loop.time()
            self._body_timer = self.loop.call_later(self._body_timeout_s, self._body_timed_out)

    def on_message_begin(self) -> None:
        if self._head_timer is None:  # a later request: its head's time starts now
            self._head_started_at = self.loop.time()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_started_at = None
        self._reading_head = False
        self._heads_read += 1
        # The request's arrival, for its latency and its wait bound: its task may start later.
        self.scope["state"][STARTED_KEY] = time.perf_counter()
        might_be_too_large = self._head_bytes + self._unmeasured > self._max_header_bytes
        self._unmeasured = 0
        if might_be_too_large and self._head_too_large():
            self._on_refusal(HEADER_TOO_LARGE)
            app, self.app = self.app, _head_too_large
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()
        if self.guard.draining:
            self.begin_drain()

    def on_message_complete(self) -> None:
        self._reading_head = True
        self._head_bytes = 0
        self._unmeasured = self._read_size
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _head_too_large(self) -> bool:
        size = head_size(self.parser.get_method(), self.url, self.headers)
        return size > self._max_header_bytes

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse(408, HEADER_TIMEOUT, "request headers not received in time")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        transport = self.transport
        if self._reading_head or transport.is_closing() or transport.get_protocol() is not self:
            return  # the body is complete, the connection ending or handed on (an upgrade)
        now = self.loop.time()
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            self._last_read_at = now  # nograd is not reading: the pause is not the client's
        idle = now - self._last_read_at
        if idle < self._body_timeout_s:
            remaining = self._body_timeout_s - idle
            self._body_timer = self.loop.call_later(remaining, self._body_timed_out)
            return
        self._refuse(408, BODY_TIMEOUT, "request body not received in time")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` and close, or, while an earlier request is still being answered
        on this connection, close once that answer is sent (a response cannot be cut into)."""
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._on_refusal(reason)
        logger.debug("connection %s refused: %s", self.client, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self._reading_head:  # the cycle is an earlier request's
                cycle.keep_alive = False
                self.flow.pause_reading()
                return
            if cycle.response_started:
                self.transport.close()
                return
            # The app waiting for this body sees the client gone, and writes nothing more.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(refusal(status, message, self.server_state.default_headers))
        self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedProtocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``, enforcing ``guard``."""
    return type("GuardedHttpToolsProtocol", (GuardedProtocol,), {"guard": guard})


def fit_file_limit(max_connections: int) -> None:
    """Raise this process's soft open-file limit (up to its hard limit) so ``max_connections``
    (and whatever else the caller adds: shared-memory regions) is reached before accepting fails
    for want of file descriptors; warn if it cannot be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FILE_HEADROOM
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if raised > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        logger.info("open-file limit raised from %d to %d for max_connections", soft, raised)
    if raised < wanted:
        logger.warning(
            "open-file limit %d is too low for max_connections=%d; accepting may fail first",
            raised,
            max_connections,
        )
