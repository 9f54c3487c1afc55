"""The serving core of one process, built once and shared by every front: metrics, the data plane,
model control and the call lifecycle, with the steps of its start-up and shutdown.

``nograd.server`` drives these steps around the fronts; an ASGI app built on its own
(``nograd.http.app.create_app``) drives them from its lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from nograd.formats.torchserve.api.management import TorchServeManagement
from nograd.formats.torchserve.reading.archives import release_all, sweep
from nograd.host.ledger import CoreShare
from nograd.observability.library_logs import route_torch_loggers
from nograd.observability.metrics import Metrics
from nograd.observability.stats import Statistics
from nograd.serving.calls.access import access_of, startup_refusal
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.control.model_control import ModelControl
from nograd.serving.control.ready_summary import log_ready
from nograd.serving.dataplane import DataPlane
from nograd.serving.extensions.diagnostics import Diagnostics
from nograd.serving.extensions.shared_memory import SharedMemory, SharedMemoryLimits
from nograd.serving.residency.frozen_heap import settle_new_libraries
from nograd.serving.residency.on_demand import OnDemand
from nograd.serving.residency.placement import Placement
from nograd.settings import Settings


class StartupFailed(Exception):
    """The server cannot start as configured (a model config or a port); the message says why."""


class Core:
    def __init__(
        self,
        settings: Settings,
        *,
        shared_dir: Path | None = None,
        cores: CoreShare | None = None,
        worker: int | None = None,
    ) -> None:
        """``worker``: this process's index among its supervisor's workers (None: a single
        server), named in the start-up summary, which the first worker logs at INFO."""
        # torch is imported by now: its loggers write through nograd's handler from here on.
        route_torch_loggers()
        self.settings = settings
        self._worker = worker
        self._scan_s = 0.0
        self.metrics = Metrics(multiprocess_dir=shared_dir)
        self.plane = DataPlane(settings, self.metrics, Statistics(shared_dir), cores=cores)
        self.control = ModelControl(self.plane, shared_dir)
        self.shared_memory = SharedMemory(
            self.control.peers,
            limits=SharedMemoryLimits(
                settings.shared_memory,
                settings.max_shared_memory_regions,
                settings.shared_memory_key_prefix,
            ),
        )
        self.on_demand = (
            OnDemand(self.control, self.plane, self.metrics)
            if settings.model_control == "on_demand"
            else None
        )
        self.placement = Placement(
            self.control,
            self.plane.registry,
            self.on_demand,
            settings.worker_count,
            self.control.peers,
        )
        self.diagnostics = Diagnostics(settings, self.plane, self.control.peers)
        self.calls = Calls(
            self.plane,
            self.metrics,
            access_of(settings),
            self.on_demand,
            self.shared_memory,
            self.diagnostics.tracer,
        )
        self.torchserve = TorchServeManagement(self.control, self.plane)
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Read the repository's configs; a malformed one fails the start-up, naming it, as
        settings that would let anyone upload code do. The archives unpacked by processes that
        are gone are removed first."""
        refusal = startup_refusal(self.settings)
        if refusal is not None:
            raise StartupFailed(refusal)
        await asyncio.to_thread(sweep, self.plane.archive_store.cache)
        await self.control.open()
        self.shared_memory.restore()
        scanning = time.perf_counter()
        self.control.discover()
        self._scan_s = time.perf_counter() - scanning
        if self.plane.config_errors:
            await self.control.close()
            raise StartupFailed("; ".join(self.plane.config_errors))

    async def load(self) -> None:
        """Load, warm and plan the start-up set of models, freeze the heap with what they and
        on-demand's warm-ups imported, before any later load (``frozen_heap``), then say what is
        served."""
        loading = time.perf_counter()
        await self.control.load_startup()
        if self.on_demand is not None:
            self.on_demand.opened()
        settle_new_libraries()
        load_s = time.perf_counter() - loading
        log_ready(self.plane.registry, scan_s=self._scan_s, load_s=load_s, worker=self._worker)

    def load_in_background(self) -> None:
        """Load while the fronts already answer: liveness says alive, readiness tells the truth
        (not ready) while weights load and warm up."""
        self._tasks.append(asyncio.create_task(self.load(), name="load-models"))

    def watch(self) -> None:
        """Restart batch loops that die, release idle sequences, and follow the repository when
        model control polls."""
        self._tasks.append(asyncio.create_task(self.plane.watch_batchers(), name="watch-batchers"))
        self._tasks.append(
            asyncio.create_task(
                self.calls.sequences.release_idle_forever(), name="release-idle-sequences"
            )
        )
        if self.settings.model_control == "poll":
            self._tasks.append(
                asyncio.create_task(self.control.poll_forever(), name="poll-repository")
            )

    async def close(self, *, force: bool = False) -> None:
        """Stop loading and watching, then the batchers: they finish what is queued within the
        drain timeout, or at once when ``force`` (a stop that cuts what is in flight)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.control.close()
        if self.on_demand is not None:
            self.on_demand.closed()
        await self.plane.stop(0.0 if force else self.settings.drain_timeout_s)
        await asyncio.to_thread(release_all)  # the archives this process unpacked, unless held
        self.shared_memory.close()
        # Off the event loop: the trace file's writer thread, or the last spans' export.
        await asyncio.get_running_loop().run_in_executor(None, self.diagnostics.close)
