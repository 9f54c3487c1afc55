"""The server of one process, assembled outside any front: the serving core, the HTTP and gRPC
fronts side by side over it, and the process's start-up, stop signals and drain.

On the first SIGTERM or Ctrl+C the server turns not-ready and refuses new inference (503,
UNAVAILABLE) while it keeps listening, so load balancers and clients see a clear answer instead
of a refused connection; every accepted request finishes; then the fronts close. The drain is
bounded by ``NOGRAD_DRAIN_TIMEOUT_S``. Repeated copies of the stop are the same stop; only a
later Ctrl+C exits at once, cutting the requests still in flight (``nograd.supervisor.stopping``).
A worker of several listens on nothing: its supervisor hands it the connections of both ports,
tells it to drain (and ignores the stop signals themselves), and ends the hand-off before the
worker may exit.
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
from typing import Final

from nograd.bridge.host import BridgeHost
from nograd.grpc.server import GrpcServer
from nograd.http.app import build_app, build_decoded_calls
from nograd.http.listener import loop_factory
from nograd.http.server import HttpFront
from nograd.observability.metrics_port import serve_metrics_port
from nograd.serving.core import Core, StartupFailed
from nograd.settings import Settings
from nograd.supervisor.handoff import GRPC, HTTP, Handoff, Inbox, bind_ports
from nograd.supervisor.stopping import DRAIN_SIGNAL, STOP_SIGNALS, StopSignals, Verdict, describe
from nograd.supervisor.worker import WorkerContext

logger = logging.getLogger(__name__)

QUIET_POLL_S: Final = 0.02
"""How often a drain looks again for requests still held."""
GRPC_GRACE_S: Final = 1.0
"""After the drain, how long gRPC calls still under way get once GOAWAY is sent."""


class Server:
    def __init__(
        self,
        settings: Settings,
        worker: WorkerContext | None = None,
        handoff: Handoff | None = None,
        *,
        engine: bool = False,
    ) -> None:
        """``engine``: the engine process of fronts (``NOGRAD_FRONTS``): its HTTP calls come
        from the front processes over the bridge, its gRPC connections from the supervisor."""
        self._settings = settings
        self._worker = worker
        self._handoff = handoff
        self.core = Core(
            settings,
            shared_dir=None if worker is None else worker.shared_dir,
            cores=None if worker is None else worker.cores,
            worker=None if worker is None else worker.index,
        )
        counted = None if handoff is None else handoff.closed
        self.http = HttpFront(self.core, counted) if settings.port and not engine else None
        self.bridge: BridgeHost | None = None
        if engine:
            assert worker is not None and worker.engine_socket is not None
            self.bridge = BridgeHost(
                build_app(self.core), worker.engine_socket, build_decoded_calls(self.core)
            )
        self.grpc = GrpcServer(self.core, counted) if settings.grpc_port else None
        self._inbox: Inbox | None = None
        self._stops = StopSignals()
        self._stop: asyncio.Event | None = None
        self._forced = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> bool:
        """Serve until stopped; False when the start-up failed."""
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(self.serve())

    async def serve(self) -> bool:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        with self._signals():
            try:
                await self.core.open()
                # Both ports before any model loads, so a taken one fails the start at once.
                sockets = bind_ports(self._settings) if self._handoff is None else {}
            except (StartupFailed, OSError) as exc:
                logger.error("start-up failed: %s", exc)
                return False
            try:
                if self._worker is not None:
                    await self._start_worker()
                else:
                    await self._start(sockets)
                self.core.watch()
                await self._stop.wait()
                await self._drain()
            finally:
                await self._shutdown()
        return True

    # ------------------------------------------------------------------ start-up
    async def _start(self, sockets: dict[bytes, socket.socket]) -> None:
        """One server: listening at once; the models load while liveness already answers and
        readiness says not ready."""
        if self.http is not None:
            await self.http.start(sockets[HTTP])
            logger.info("HTTP listening on %s:%d", self._settings.host, self._settings.port)
        if self.grpc is not None:
            await self.grpc.start(sockets[GRPC])
        if self._settings.metrics_port is not None:
            serve_metrics_port(
                self._settings.host,
                self._settings.metrics_port,
                self.core.metrics.exposition,
                self._settings.metrics_keys,
            )
            logger.info("metrics also served on port %d", self._settings.metrics_port)
        self.core.load_in_background()

    async def _start_worker(self) -> None:
        """A worker: warm before its supervisor hands it a connection."""
        assert self._worker is not None and self._handoff is not None and self._loop is not None
        await self.core.load()
        if self.bridge is not None:
            await self.bridge.start()
        factories = {}
        if self.http is not None:
            await self.http.start(None)
            factories[HTTP] = self.http.protocol
        if self.grpc is not None:
            await self.grpc.start(None)
            factories[GRPC] = self.grpc.protocol
        self._inbox = Inbox(self._handoff, self._loop, factories)
        self._inbox.open()
        self._worker.ready()

    # ------------------------------------------------------------------ stop
    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Listen to the stop signals (a worker: only to its supervisor's drain signal; the stop
        signals stay ignored)."""
        signals = (DRAIN_SIGNAL,) if self._handoff is not None else STOP_SIGNALS
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        del frame
        verdict = self._stops.receive(sig)
        if sig == DRAIN_SIGNAL:
            logger.info("told to stop by the supervisor")
        else:
            logger.info("%s", describe(sig, verdict))
        if verdict is Verdict.FORCE:
            self._forced = True
            if self.http is not None:
                self.http.cut()
        if verdict is not Verdict.SAME and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _drain(self) -> None:
        """Refuse new work and wait until no request is held anywhere, or the drain timeout."""
        if self._forced or self._settings.drain_timeout_s <= 0:
            return
        started = time.monotonic()
        deadline = started + self._settings.drain_timeout_s
        self.core.plane.begin_drain()
        if self.http is not None:
            self.http.begin_drain()
        logger.info("draining: not ready, refusing new requests")
        idle = await self._until_quiet(deadline)
        if self._inbox is not None and idle:
            # A worker: its supervisor may still hand it connections (each answered 503). It
            # finishes once the supervisor stopped accepting and ended the channel, and what
            # came through it is answered.
            self._inbox.report_quiet()
            remaining = max(0.0, deadline - time.monotonic())
            idle = await self._inbox.wait_ended(remaining) and await self._until_quiet(deadline)
            if self.bridge is not None and idle:
                # The engine: the fronts finish their own drains with calls still to forward.
                idle = await self._until_fronts_gone(deadline)
        logger.info(
            "drain finished in %.2fs%s; shutting down",
            time.monotonic() - started,
            "" if idle else " with work still in flight",
        )

    async def _until_quiet(self, deadline: float) -> bool:
        """Wait until no request is held: in the data plane (admitted, or in inference), or in
        a front (parsed but not yet admitted, or on a connection accepted moments ago whose
        bytes are unread). Ending the drain earlier closes the ports and the accepted
        connections while their requests still wait for an answer. False: the deadline passed,
        or a later Ctrl+C asked to stop at once."""
        while not self._forced:
            if not self._holds_requests():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return False

    async def _until_fronts_gone(self, deadline: float) -> bool:
        """Serve the fronts' calls until every front has closed its connection (it exits once
        it holds no request), or the deadline."""
        assert self.bridge is not None
        while self.bridge.connections or self._holds_requests():
            if self._forced or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return True

    def _holds_requests(self) -> bool:
        if not self.core.plane.idle:
            return True
        if self.bridge is not None and self.bridge.open_streams:
            return True
        if self._inbox is not None and self._inbox.adopting:
            return True
        if self.http is not None and self.http.holds_requests():
            return True
        return self.grpc is not None and self.grpc.holds_calls

    async def _shutdown(self) -> None:
        forced = self._forced
        if self.http is not None:
            await self.http.stop(force=forced)
        if self.grpc is not None:
            await self.grpc.stop(grace_s=0.0 if forced else GRPC_GRACE_S)
        if self.bridge is not None:
            await self.bridge.stop()
        if self._inbox is not None:
            self._inbox.close()
        await self.core.close(force=forced)


def serve(settings: Settings) -> bool:
    """The ``nograd`` command with one process: serve until stopped."""
    return Server(settings).run()


def serve_worker(settings: Settings, context: WorkerContext, handoff: Handoff) -> bool:
    """One worker process of several: serves the connections the supervisor hands it."""
    return Server(settings, context, handoff).run()


def serve_engine(settings: Settings, context: WorkerContext, handoff: Handoff) -> bool:
    """The engine process of fronts: every model loaded once, HTTP calls from the front
    processes, gRPC connections from the supervisor."""
    return Server(settings, context, handoff, engine=True).run()
