"""Running the app under uvicorn with a graceful drain on SIGTERM.

On the first SIGTERM nograd turns not-ready at once and refuses new inference with 503 while it
keeps listening, so load balancers and clients see a clear answer instead of a refused
connection; every accepted request finishes; then uvicorn shuts down. The whole drain is bounded
by ``NOGRAD_DRAIN_TIMEOUT_S``. A second signal (or Ctrl+C) exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI
from prometheus_client import start_http_server

from app.dataplane import DataPlane
from app.main import create_app
from app.settings import Settings

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, plane: DataPlane, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._plane = plane
        self._drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first_term = sig == signal.SIGTERM and self._drain_task is None and not self.should_exit
        if first_term and self._loop is not None and self._drain_timeout_s > 0:
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        # Whatever happens while draining, the process must still exit: should_exit is set in
        # finally, so a failure here can never leave a server that ignored its SIGTERM.
        started = time.monotonic()
        idle = False
        try:
            self._plane.begin_drain()
            logger.info("SIGTERM: draining (not ready, refusing new requests)")
            idle = await self._plane.wait_idle(self._drain_timeout_s)
        finally:
            logger.info(
                "drain finished in %.2fs%s; shutting down",
                time.monotonic() - started,
                "" if idle else " with work still in flight",
            )
            self.should_exit = True


def build_server(settings: Settings, app: FastAPI | None = None) -> DrainingServer:
    app = app or create_app(settings)
    plane = app.state.dataplane
    assert isinstance(plane, DataPlane)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
    )
    return DrainingServer(config, plane, settings.drain_timeout_s)


def serve(settings: Settings) -> None:
    app = create_app(settings)
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, settings.host, app.state.metrics.exposition)
        logger.info("metrics also served on port %d", settings.metrics_port)
    build_server(settings, app).run()
