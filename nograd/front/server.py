"""A front process: the HTTP connections its supervisor hands it, served without torch, every
call forwarded to the engine process (``nograd.front.app``).

It starts in about a second (no models, no torch), beside the engine, and is ready once it
reaches the engine (warm by then). It drains as a server does: on its supervisor's word it ends
each connection after its next answer, waits until it holds no request and no call is still
with the engine, says so, and exits once no connection can still reach it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from types import FrameType
from typing import Final

from nograd.bridge.link import EngineLink
from nograd.front.app import ForwardingApp
from nograd.http.listener import HttpListener, loop_factory
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.serving.calls.access import access_of
from nograd.settings import Settings
from nograd.supervisor.handoff import HTTP, Handoff, Inbox
from nograd.supervisor.stopping import DRAIN_SIGNAL
from nograd.supervisor.worker import WorkerContext

logger = logging.getLogger(__name__)

QUIET_POLL_S: Final = 0.02


class FrontServer:
    def __init__(self, settings: Settings, context: WorkerContext, handoff: Handoff) -> None:
        assert context.engine_socket is not None
        self._settings = settings
        self._context = context
        self._handoff = handoff
        metrics = Metrics(multiprocess_dir=context.shared_dir)

        def count_refusal(reason: str) -> None:
            metrics.rejected.labels(UNKNOWN_MODEL, reason).inc()

        self.link = EngineLink(context.engine_socket)
        self.http = HttpListener(
            ForwardingApp(self.link, settings.max_decoded_bytes, access_of(settings)),
            settings,
            count_refusal,
            handoff.closed,
        )
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> bool:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(self.serve())

    async def serve(self) -> bool:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        previous = signal.signal(DRAIN_SIGNAL, self._on_signal)
        linking = asyncio.create_task(self.link.run(), name="engine-link")
        inbox: Inbox | None = None
        listening = False
        try:
            # Started beside the engine: it listens once its models are warm.
            connected = asyncio.create_task(self.link.connected.wait())
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait({connected, stopped}, return_when=asyncio.FIRST_COMPLETED)
            connected.cancel()
            stopped.cancel()
            if not self.link.up:
                return True  # stopped before the engine was warm
            await self.http.start(None)
            listening = True
            inbox = Inbox(self._handoff, self._loop, {HTTP: self.http.protocol})
            inbox.open()
            self._context.ready()
            await self._stop.wait()
            await self._drain(inbox)
        finally:
            if listening:
                await self.http.stop(force=False)
            if inbox is not None:
                inbox.close()
            if listening:
                # The engine finishes its own drain once every front's connection is closed.
                logger.info(
                    "front %d drained; closing its connection to the engine", self._context.index
                )
            self.link.close()
            linking.cancel()
            signal.signal(DRAIN_SIGNAL, previous)
        return True

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        del sig, frame
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _drain(self, inbox: Inbox) -> None:
        if self._settings.drain_timeout_s <= 0:
            return  # no drain asked for: the calls under way are cut, as a server's are
        deadline = time.monotonic() + self._settings.drain_timeout_s
        self.http.begin_drain()
        idle = await self._until_quiet(inbox, deadline)
        if idle:
            inbox.report_quiet()
            remaining = max(0.0, deadline - time.monotonic())
            idle = await inbox.wait_ended(remaining) and await self._until_quiet(inbox, deadline)
        if not idle:
            logger.warning("front %d stops with calls still in flight", self._context.index)

    async def _until_quiet(self, inbox: Inbox, deadline: float) -> bool:
        while self._holds_requests(inbox):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return True

    def _holds_requests(self, inbox: Inbox) -> bool:
        return inbox.adopting or self.http.holds_requests() or self.link.open_streams > 0


def serve_front(settings: Settings, context: WorkerContext, handoff: Handoff) -> bool:
    """One front process of the engine's (``NOGRAD_FRONTS``), below its CPU priority."""
    if settings.front_nice:
        try:
            os.nice(settings.front_nice)
        except OSError as exc:  # raising one's own nice value is always allowed on Linux
            logger.warning("front priority not lowered (NOGRAD_FRONT_NICE): %s", exc)
    return FrontServer(settings, context, handoff).run()
