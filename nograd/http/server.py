"""Running the app under uvicorn with a graceful drain on a stop signal.

On the first SIGTERM or Ctrl+C nograd turns not-ready at once and refuses new inference with 503
while it keeps listening, so load balancers and clients see a clear answer instead of a refused
connection; every accepted request finishes; then uvicorn shuts down. The whole drain is bounded
by ``NOGRAD_DRAIN_TIMEOUT_S``. Repeated copies of the stop are the same stop; only a later Ctrl+C
exits at once, cutting the requests still in flight (``nograd.supervisor.stopping``). A worker of
several drains on its supervisor's word instead and ignores the stop signals themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI
from prometheus_client import start_http_server

from nograd.http.app import create_app
from nograd.http.connections import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedProtocol,
    fit_file_limit,
    guarded_protocol,
)
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.serving.dataplane import DataPlane
from nograd.settings import Settings
from nograd.supervisor.handoff import Handoff, Inbox, counting
from nograd.supervisor.stopping import DRAIN_SIGNAL, STOP_SIGNALS, StopSignals, Verdict, describe
from nograd.supervisor.worker import WorkerContext

logger = logging.getLogger(__name__)

QUIET_POLL_S = 0.02
"""How often a drain looks again for requests still held by uvicorn."""


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        plane: DataPlane,
        drain_timeout_s: float,
        handoff: Handoff | None = None,
    ) -> None:
        super().__init__(config)
        self._plane = plane
        self._drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handoff = handoff
        self._inbox: Inbox | None = None
        self._stops = StopSignals()

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self._handoff is None:
            await super().startup(sockets)
            return
        # A worker listens on nothing (an empty list keeps uvicorn from binding the port): its
        # connections come from the supervisor, accepted there and passed over the channel.
        await super().startup([])
        loop = self._loop
        assert loop is not None  # set by serve()
        protocol = counting(self.config.http_protocol_class, self._handoff.closed)
        config, state = self.config, self.server_state

        def create_protocol() -> asyncio.Protocol:
            return protocol(  # type: ignore[call-arg]
                config=config, server_state=state, app_state=self.lifespan.state, _loop=loop
            )

        self._inbox = Inbox(self._handoff, loop, create_protocol)
        self._inbox.open()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._inbox is not None:
            self._inbox.close()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Listen to the stop signals (a worker: only to its supervisor's drain signal; the stop
        signals stay ignored), and never re-raise them after the shutdown as uvicorn would."""
        signals = (DRAIN_SIGNAL,) if self._handoff is not None else STOP_SIGNALS
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        del frame
        verdict = self._stops.receive(sig)
        if sig == DRAIN_SIGNAL:
            logger.info("told to stop by the supervisor")
        else:
            logger.info("%s", describe(sig, verdict))
        if verdict is Verdict.FORCE:
            # uvicorn's own shutdown would still wait for open connections and the models'
            # queues; requests still in flight are cut.
            self.force_exit = True
            self.should_exit = True
        elif verdict is Verdict.DRAIN:
            if self._loop is not None and self._drain_timeout_s > 0:
                self._loop.call_soon_threadsafe(self._start_drain)
            else:
                self.should_exit = True

    def _start_drain(self) -> None:
        # Scheduled once (the first signal); the reference keeps the task alive.
        self._drain_task = asyncio.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        # Whatever happens while draining, the process must still exit: should_exit is set in
        # finally, so a failure here can never leave a server that ignored its SIGTERM.
        started = time.monotonic()
        idle = False
        try:
            self._plane.begin_drain()
            logger.info("draining: not ready, refusing new requests")
            deadline = started + self._drain_timeout_s
            idle = await self._wait_quiet(deadline)
            if self._inbox is not None and idle:
                # A worker: its supervisor may still be handing it connections (each answered
                # 503). It finishes once the supervisor stopped accepting and ended the channel,
                # and what came through it is answered.
                self._inbox.report_quiet()
                remaining = max(0.0, deadline - time.monotonic())
                idle = await self._inbox.wait_ended(remaining) and await self._wait_quiet(deadline)
        finally:
            logger.info(
                "drain finished in %.2fs%s; shutting down",
                time.monotonic() - started,
                "" if idle else " with work still in flight",
            )
            self.should_exit = True

    async def _wait_quiet(self, deadline: float) -> bool:
        """Wait until no request is held anywhere, or ``deadline`` passes (False): neither in
        the data plane nor in uvicorn, whose requests may not have reached admission yet (a
        head just parsed, or not yet read from a connection accepted moments ago, on a loaded
        machine). Ending the drain earlier closes the port and the accepted connections while
        their requests still wait for an answer; new connections are bounded by the header
        timeout (408), so none can hold the drain past it."""
        while True:
            if not await self._plane.wait_idle(max(0.0, deadline - time.monotonic())):
                return False
            if not self._requests_held():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIET_POLL_S)

    def _requests_held(self) -> bool:
        state = self.server_state
        if state.tasks or (self._inbox is not None and self._inbox.adopting):
            return True
        return any(
            isinstance(c, GuardedProtocol) and c.expecting_request for c in state.connections
        )


def build_server(
    settings: Settings, app: FastAPI | None = None, *, handoff: Handoff | None = None
) -> DrainingServer:
    app = app or create_app(settings)
    plane = app.state.dataplane
    assert isinstance(plane, DataPlane)
    metrics = app.state.metrics
    assert isinstance(metrics, Metrics)

    def count_refusal(reason: str) -> None:
        metrics.rejected.labels(UNKNOWN_MODEL, reason).inc()

    # Slow and oversized requests are cut off and connections capped, in both modes: a worker
    # builds its protocols from the same class (``DrainingServer.startup``).
    guard = ConnectionGuard(ConnectionLimits.from_settings(settings), count_refusal)
    fit_file_limit(settings.max_connections)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=guarded_protocol(guard),
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
    )
    return DrainingServer(config, plane, settings.drain_timeout_s, handoff)


def serve_worker(settings: Settings, context: WorkerContext, handoff: Handoff) -> bool:
    """One worker process of several: serves the connections the supervisor hands it."""
    server = build_server(settings, create_app(settings, worker=context), handoff=handoff)
    server.run()
    return bool(server.started)


def serve(settings: Settings) -> None:
    app = create_app(settings)
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, settings.host, app.state.metrics.exposition)
        logger.info("metrics also served on port %d", settings.metrics_port)
    build_server(settings, app).run()
