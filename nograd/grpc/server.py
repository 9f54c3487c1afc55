"""The gRPC server of one process: nograd's HTTP/2 transport (``nograd.grpc.h2``) on the process's
own event loop, so its calls reach the same data plane and batchers as HTTP's.

With several worker processes each binds the port with ``SO_REUSEPORT``, and the kernel spreads
new connections among them. An HTTP/2 connection is long-lived, so one client channel stays with
the worker that accepted it; clients that open several channels (or several clients) spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Mapping
from typing import Final

from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.generated import health_pb2
from nograd.grpc.h2 import Http2Connection
from nograd.grpc.health import Health
from nograd.grpc.rpc import GrpcCalls, Method
from nograd.grpc.service import InferenceService
from nograd.observability.metrics import Metrics
from nograd.serving.control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings

logger = logging.getLogger(__name__)
SERVICE_NAME: Final = "inference.GRPCInferenceService"
MAX_MESSAGE_BYTES_MARGIN: Final = 1024 * 1024
"""Room above the largest request body for the message's own framing."""
BACKLOG: Final = 2048


def inference_methods(service: InferenceService) -> dict[str, Method]:
    """Every RPC of the service's definition that ``service`` answers, by its HTTP/2 path."""
    methods: dict[str, Method] = {}
    definition = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for rpc in definition.methods:
        function = getattr(service, rpc.name, None)
        if function is None or rpc.client_streaming or rpc.server_streaming:
            continue
        methods[f"/{SERVICE_NAME}/{rpc.name}"] = Method(
            getattr(pb, rpc.input_type.name), unary=function
        )
    return methods


def health_methods(health: Health) -> dict[str, Method]:
    request = health_pb2.HealthCheckRequest
    return {
        "/grpc.health.v1.Health/Check": Method(request, unary=health.check),
        "/grpc.health.v1.Health/Watch": Method(request, server_streaming=health.watch),
    }


class GrpcServer:
    """Bound when built (a taken port fails the start-up at once), listening from ``start``."""

    def __init__(
        self,
        settings: Settings,
        plane: DataPlane,
        control: ModelControl,
        metrics: Metrics,
        *,
        shared_port: bool,
    ) -> None:
        self._settings = settings
        self._health = Health(plane.ready)
        service = InferenceService(
            plane, control, metrics, settings.api_key_list, protect_health=settings.auth_health
        )
        methods: Mapping[str, Method] = {
            **inference_methods(service),
            **health_methods(self._health),
        }
        self._calls = GrpcCalls(methods, settings.max_request_bytes + MAX_MESSAGE_BYTES_MARGIN)
        self._connections: set[Http2Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sock = _bind(settings.host, settings.grpc_port, shared_port)
        self.port = int(self._sock.getsockname()[1])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, sock=self._sock, backlog=BACKLOG)
        self._health.start()
        logger.info("gRPC listening on port %d", self.port)

    def _connection(self) -> Http2Connection:
        connection: Http2Connection

        def closed() -> None:
            self._connections.discard(connection)

        connection = Http2Connection(self._calls, self._settings.max_requests_in_flight, closed)
        self._connections.add(connection)
        return connection

    @property
    def holds_calls(self) -> bool:
        """A call is being answered (streams that only watch health do not count)."""
        return bool(self._calls.calls)

    async def stop(self, grace_s: float) -> None:
        """Take no new connection or call (GOAWAY), give the calls under way ``grace_s`` to
        finish (the drain has already waited for every accepted inference, whichever transport
        it came by), then close every connection."""
        await self._health.stop()
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.go_away()
        calls = list(self._calls.calls)
        if calls:
            await asyncio.wait(calls, timeout=grace_s)
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
        self._sock.close()


def _bind(host: str, port: int, shared: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        # Workers share the port; a single process must own it, so a second server started on
        # the same port fails instead of silently taking half its calls.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen for gRPC on {host}:{port}: the port is taken or the address is not "
            "this host's (NOGRAD_GRPC_PORT; 0 turns gRPC off)"
        ) from exc
    sock.setblocking(False)
    return sock
