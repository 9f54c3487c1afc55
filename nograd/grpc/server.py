"""The gRPC server of one process: grpcio's asyncio server on the process's own event loop, so
its calls reach the same data plane and batchers as HTTP's.

With several worker processes each binds the port with ``SO_REUSEPORT``, and the kernel spreads
new connections among them. An HTTP/2 channel is one long-lived connection, so
one client channel stays with the worker that accepted it; clients that open several channels
(or several clients) spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nograd.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from nograd.grpc.service import InferenceService
from nograd.observability.metrics import Metrics
from nograd.serving.control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings

logger = logging.getLogger(__name__)
SERVICE_NAME = "inference.GRPCInferenceService"
MAX_MESSAGE_BYTES_MARGIN = 1024 * 1024
"""Room above the largest request body for the message's own framing."""


class ReadinessHealth(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1 saying what the readiness route says, at the moment it is asked: not
    serving while loading or draining, or while a model's batch loop is down."""

    def __init__(self, plane: DataPlane) -> None:
        super().__init__()
        self._plane = plane

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", SERVICE_NAME):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        serving = self._plane.ready()
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )


class GrpcServer:
    """Started once the models are loaded, stopped after the HTTP drain."""

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
        self._plane = plane
        self._health = ReadinessHealth(plane)
        self._watch: asyncio.Task[None] | None = None
        limit = settings.max_request_bytes + MAX_MESSAGE_BYTES_MARGIN
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", -1),
                # Workers share the port; a single process must own it, so a second server
                # started on the same port fails instead of silently taking half its calls.
                ("grpc.so_reuseport", 1 if shared_port else 0),
            ],
            maximum_concurrent_rpcs=settings.max_requests_in_flight + 64,
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            InferenceService(
                plane,
                control,
                metrics,
                settings.api_key_list,
                protect_health=settings.auth_health,
            ),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        address = f"{settings.host}:{settings.grpc_port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            self.port = 0
            cause: Exception | None = exc
        else:
            cause = None
        if self.port == 0:
            raise OSError(
                f"cannot listen for gRPC on {address}: the port is taken or the address is "
                "not this host's (NOGRAD_GRPC_PORT; 0 turns gRPC off)"
            ) from cause

    async def start(self) -> None:
        await self._server.start()
        self._watch = asyncio.create_task(self._follow_readiness(), name="grpc-health")
        logger.info("gRPC listening on port %d", self.port)

    async def _follow_readiness(self, interval_s: float = 0.5) -> None:
        """Keep grpc.health.v1's Watch streams told of readiness changes (Check reads it live)."""
        serving: bool | None = None
        while True:
            ready = self._plane.ready()
            if ready != serving:
                await self._set_serving(ready)
                serving = ready
            await asyncio.sleep(interval_s)

    async def _set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls and give accepted ones ``grace_s`` to finish (the HTTP drain has
        already waited for every accepted inference, whichever transport it came by)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._set_serving(False)
        await self._server.stop(grace_s)
