"""The gRPC front of one process: nograd's HTTP/2 transport (``nograd.grpc.h2``) on the process's
own event loop, so its calls reach the same data plane and batchers as HTTP's.

With several worker processes the supervisor accepts gRPC connections as it does HTTP's and hands
each to the least busy worker. An HTTP/2 connection is long-lived, so one client channel stays
with the worker it was handed to; clients that open several channels (or several clients) spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import socket
from collections.abc import Mapping
from typing import Final

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.generated import health_pb2
from nograd.grpc.h2 import Http2Connection, SendLimits
from nograd.grpc.health import Health
from nograd.grpc.rpc import GrpcCalls, Limit, Method
from nograd.grpc.service import InferenceService
from nograd.serving.core import Core
from nograd.settings import Settings

logger = logging.getLogger(__name__)
SERVICE_NAME: Final = "inference.GRPCInferenceService"
TOO_MANY_CONNECTIONS: Final = "too_many_connections"
"""The rejection reason HTTP's connection cap counts too."""
BACKLOG: Final = 2048
"""Connections the kernel queues for the port (uvicorn's default backlog)."""


HEALTH_RPCS: Final = frozenset({"ServerLive", "ServerReady"})
"""The service's own health probes, held within the health calls' limit as grpc.health.v1's."""


class HealthLimits:
    """The limits health calls hold, per process, apart from inference's: every health call one
    place of ``calls``; a watch, which lasts as long as its client wants, one of ``watches``
    too."""

    def __init__(self, settings: Settings) -> None:
        calls, watches = settings.grpc_max_health_calls, settings.grpc_max_health_watches
        self.calls = Limit(
            calls,
            f"too many health calls at once (NOGRAD_GRPC_MAX_HEALTH_CALLS={calls}); retry later",
            "health_calls",
        )
        self.watches = Limit(
            watches,
            f"too many health watches open (NOGRAD_GRPC_MAX_HEALTH_WATCHES={watches}); "
            "use Check, or retry later",
            "health_watches",
        )


def inference_methods(service: InferenceService, limits: HealthLimits) -> dict[str, Method]:
    """Every RPC of the service's definition that ``service`` answers, by its HTTP/2 path."""
    methods: dict[str, Method] = {}
    definition = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for rpc in definition.methods:
        function = getattr(service, rpc.name, None)
        if function is None:
            continue
        if rpc.client_streaming and rpc.server_streaming:
            methods[f"/{SERVICE_NAME}/{rpc.name}"] = Method(
                getattr(pb, rpc.input_type.name), bidi_streaming=function
            )
            continue
        if rpc.client_streaming or rpc.server_streaming:
            continue
        methods[f"/{SERVICE_NAME}/{rpc.name}"] = Method(
            getattr(pb, rpc.input_type.name),
            unary=service.restricted(rpc.name, function),
            limits=(limits.calls,) if rpc.name in HEALTH_RPCS else (),
            holds_body=rpc.name not in HEALTH_RPCS,
        )
    return methods


def health_methods(health: Health, limits: HealthLimits) -> dict[str, Method]:
    request = health_pb2.HealthCheckRequest
    return {
        "/grpc.health.v1.Health/Check": Method(
            request, unary=health.check, limits=(limits.calls,), holds_body=False
        ),
        "/grpc.health.v1.Health/Watch": Method(
            request,
            server_streaming=health.watch,
            limits=(limits.calls, limits.watches),
            holds_body=False,
        ),
    }


class GrpcServer:
    """The gRPC front: listening on a socket the server bound, or serving connections handed
    over by a supervisor."""

    def __init__(self, core: Core, closed: ctypes.c_longlong | None = None) -> None:
        """``closed``: a count of closed connections to keep (a worker's, for its supervisor)."""
        settings = core.settings
        self._settings = settings
        self._closed = closed
        service = InferenceService(core, protect_health=settings.auth_health)
        self._health = Health(core.plane.ready, service.authorize if settings.auth_health else None)
        limits = HealthLimits(settings)
        methods: Mapping[str, Method] = {
            **inference_methods(service, limits),
            **health_methods(self._health, limits),
        }
        unknown = core.calls.label(None)
        rejected = core.metrics.rejected

        def refused(reason: str) -> None:
            rejected.labels(unknown, reason).inc()

        self._refused = refused
        self._calls = GrpcCalls(methods, settings.max_message_bytes, refused, core.calls)
        self._connections: set[Http2Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._send_limits = SendLimits(
            settings.grpc_max_unsent_stream_bytes,
            settings.grpc_max_unsent_connection_bytes,
            settings.grpc_unsent_timeout_s,
        )

    async def start(self, sock: socket.socket | None) -> None:
        """Listen on ``sock``; None: take only the connections ``protocol`` is asked for."""
        if sock is not None:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(self.protocol, sock=sock, backlog=BACKLOG)
            logger.info("gRPC listening on port %d", sock.getsockname()[1])
        self._health.start()

    def protocol(self) -> Http2Connection:
        """A connection's protocol, for one accepted here or handed over."""
        connection: Http2Connection

        def closed() -> None:
            self._connections.discard(connection)
            if self._closed is not None:
                self._closed.value += 1

        settings = self._settings
        refusal = None
        if len(self._connections) >= settings.max_connections:
            self._refused(TOO_MANY_CONNECTIONS)
            refusal = (
                f"too many connections (NOGRAD_MAX_CONNECTIONS={settings.max_connections}); "
                "retry later"
            )
        connection = Http2Connection(
            self._calls,
            settings.grpc_max_concurrent_streams,
            closed,
            settings.header_timeout_s,
            refusal,
            self._send_limits,
        )
        if refusal is None:  # a refused one is answered and closed, never counted as open
            self._connections.add(connection)
        return connection

    @property
    def holds_calls(self) -> bool:
        """A call is being answered (streams that only watch health do not count)."""
        return bool(self._calls.calls)

    async def stop(self, grace_s: float) -> None:
        """Take no new connection or call (GOAWAY), give the calls under way ``grace_s`` to
        finish (the drain has already waited for every accepted call), then close every
        connection."""
        await self._health.stop()
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.go_away()
        calls = list(self._calls.calls)
        if calls and grace_s > 0:
            await asyncio.wait(calls, timeout=grace_s)
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
