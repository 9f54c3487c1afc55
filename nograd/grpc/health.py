"""grpc.health.v1, saying what the readiness route says: not serving while loading or draining, or
while a model's batch loop is down. ``Check`` reads readiness when asked; ``Watch`` streams each
change, from one task that follows readiness for every stream. Both need an API key exactly when
HTTP's health routes do (``NOGRAD_AUTH_HEALTH``); how many run at once is bounded apart from
inference by the gRPC server (``nograd.grpc.server``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Final

from nograd.grpc.generated import health_pb2
from nograd.grpc.rpc import CallContext, Code
from nograd.serving.errors import Unauthenticated

SERVICES: Final = ("", "inference.GRPCInferenceService")
"""The names a health check may ask about: the whole server, or the inference service."""
FOLLOW_INTERVAL_S: Final = 0.5

_SERVING: Final = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN_SERVICE: Final = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health:
    def __init__(
        self, ready: Callable[[], bool], authorize: Callable[[CallContext], None] | None = None
    ) -> None:
        """``authorize``: checks a call's key (raising ``Unauthenticated``); None: open."""
        self._ready = ready
        self._authorize = authorize
        self._changed = asyncio.Condition()
        self._serving: bool | None = None
        self._follower: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._follower = asyncio.create_task(self._follow(), name="grpc-health")

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    async def _follow(self) -> None:
        while True:
            serving = self._ready()
            if serving != self._serving:
                self._serving = serving
                async with self._changed:
                    self._changed.notify_all()
            await asyncio.sleep(FOLLOW_INTERVAL_S)

    async def _check_key(self, context: CallContext) -> None:
        if self._authorize is None:
            return
        try:
            self._authorize(context)
        except Unauthenticated as exc:
            await context.abort(Code.UNAUTHENTICATED, str(exc))

    async def check(
        self, request: health_pb2.HealthCheckRequest, context: CallContext
    ) -> health_pb2.HealthCheckResponse:
        await self._check_key(context)
        if request.service not in SERVICES:
            await context.abort(Code.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=_SERVING if self._ready() else _NOT_SERVING)

    async def watch(
        self, request: health_pb2.HealthCheckRequest, context: CallContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        await self._check_key(context)
        if request.service not in SERVICES:
            # The spec's answer: unknown now, and the stream stays open.
            yield health_pb2.HealthCheckResponse(status=_UNKNOWN_SERVICE)
            await asyncio.Event().wait()
        sent: bool | None = None
        while True:
            serving = self._ready()
            if serving != sent:
                sent = serving
                yield health_pb2.HealthCheckResponse(status=_SERVING if serving else _NOT_SERVING)
            async with self._changed:
                await self._changed.wait()
