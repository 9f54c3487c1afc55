"""The HTTP listener: an ASGI app under uvicorn's HTTP/1.1 protocol with nograd's connection
guard, listening on a socket the server bound, or serving connections handed over by a
supervisor. It knows no serving core: a server process runs its app over the core, a front
process (``nograd.front``) an app that forwards to the engine process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from nograd.http.connections import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedProtocol,
    fit_file_limit,
    guarded_protocol,
)
from nograd.settings import Settings


class HttpListener:
    """An ASGI app under uvicorn's HTTP/1.1 protocol with nograd's connection guard."""

    def __init__(
        self,
        app: Any,
        settings: Settings,
        count_refusal: Callable[[str], None],
        closed: ctypes.c_longlong | None = None,
    ) -> None:
        """``count_refusal``: counts a connection or request the guard refused, by reason;
        ``closed``: a count of closed connections to keep (a worker's, for its supervisor)."""
        # Slow and oversized requests are cut off and connections capped, on a port of its own
        # or on connections handed over alike.
        self._guard = ConnectionGuard(ConnectionLimits.from_settings(settings), count_refusal)
        # Each shared-memory region holds a descriptor: room for them besides the connections.
        fit_file_limit(settings.max_connections + settings.max_shared_memory_regions)
        protocol = guarded_protocol(self._guard)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http=protocol if closed is None else _counting(protocol, closed),
            lifespan="off",
            log_level=settings.log_level,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        )
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        self._ticker: asyncio.Task[None] | None = None

    async def start(self, sock: socket.socket | None) -> None:
        """Listen on ``sock``; None: take only the connections ``protocol`` is asked for."""
        await self._server.startup([] if sock is None else [sock])
        # uvicorn's own loop keeps the Date header current (and nothing else nograd uses).
        self._ticker = asyncio.create_task(self._server.main_loop(), name="http-ticker")

    def protocol(self) -> asyncio.Protocol:
        """A protocol for one connection accepted elsewhere."""
        server = self._server
        made: asyncio.Protocol = server.config.http_protocol_class(  # type: ignore[call-arg]
            config=server.config,
            server_state=server.server_state,
            app_state=server.lifespan.state,
            _loop=asyncio.get_running_loop(),
        )
        return made

    def begin_drain(self) -> None:
        """Every response from now on ends its connection, those under way included, so no
        client sends another request on a connection that is about to close."""
        self._guard.draining = True
        for connection in self._server.server_state.connections:
            if isinstance(connection, GuardedProtocol):
                connection.begin_drain()

    def holds_requests(self) -> bool:
        """A request is being answered, or may be on its way on a connection this front
        accepted: part of its head arrived, the connection is new (its bytes may be unread yet,
        on a loaded machine), or it is kept alive from before the drain (its client may be
        sending the next request). New connections hold it at most the header timeout (408),
        kept-alive ones the keep-alive timeout."""
        state = self._server.server_state
        if state.tasks:
            return True
        return any(
            isinstance(c, GuardedProtocol) and c.expecting_request for c in state.connections
        )

    def cut(self) -> None:
        """Stop waiting for the requests under way (a later Ctrl+C): a shutdown in progress
        ends at once."""
        self._server.force_exit = True

    async def stop(self, *, force: bool) -> None:
        """Close the port and the idle connections, then wait for the requests under way (unless
        ``force``: they are cut)."""
        self._server.should_exit = True
        self._server.force_exit = self._server.force_exit or force
        if self._ticker is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self._server.shutdown()


def _counting(base: type[GuardedProtocol], closed: ctypes.c_longlong) -> type[GuardedProtocol]:
    """``base`` that counts its closed connections in ``closed``."""

    def connection_lost(self: GuardedProtocol, exc: Exception | None) -> None:
        try:
            base.connection_lost(self, exc)
        finally:
            closed.value += 1

    return type(f"Counted{base.__name__}", (base,), {"connection_lost": connection_lost})


def loop_factory() -> type[asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (uvicorn's choice too), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    loop_class: type[asyncio.AbstractEventLoop] = uvloop.Loop
    return loop_class
