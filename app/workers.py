"""Several server processes on one port (``NOGRAD_WORKERS`` > 1).

One nograd process is bound by Python's GIL: for a small model the event loop, JSON and the
batcher's bookkeeping fill one core while the forward needs little, so a second core idles. Here
a supervisor process starts that many workers (spawned, so none inherits torch or OpenMP state);
each is a whole nograd server with its own models, batchers and device thread, listening on the
port with ``SO_REUSEPORT``, so the kernel spreads new connections evenly over the listening
workers. (One shared listening socket was tried first: an idle worker's event loop accepted a
whole burst at once, and a client's 32 connections could all land on one worker.)

- Workers start one after another (start-up work never competes for the cores), and they start
  listening together once all are warm, so no connection is handed to a cold worker and clients
  that connect early spread over all of them; a restarted worker listens once it is warm. Each
  budgets an equal share of the device memory it finds free.
- The supervisor holds the port bound (never listening, so the kernel hands it no connection):
  the port is checked once at start, ``--port 0`` picks one port for all, and no other program
  can take the port while a worker restarts.
- Connections stay with the worker that accepted them: requests on one keep-alive connection are
  served by one worker. Connections still waiting in a dying worker's accept queue are reset by
  the kernel (unless ``net.ipv4.tcp_migrate_req`` is on).
- Metrics live in files in one folder (prometheus_client's multiprocess mode), so /metrics on any
  worker, and ``NOGRAD_METRICS_PORT`` on the supervisor, report the whole server.
- SIGTERM (or Ctrl+C) reaches every worker as SIGTERM: each drains as a single server does; a
  second signal kills the workers at once, cutting the requests still in flight. A
  worker that dies while serving is started again, after a delay that grows while it keeps dying;
  one that dies during the first start-up stops the server, as a failed single server would.

This module imports no torch: the supervisor stays small, and only workers load models.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from types import FrameType

from app.settings import Settings

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STARTUP_FAILURE = 3
"""Exit code of a worker whose start-up failed (uvicorn's own code for it)."""
RESTART_DELAY_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A worker that served this long before dying is restarted at once."""


@dataclass(frozen=True)
class WorkerRole:
    """What one worker process knows of the others."""

    multiprocess_dir: Path
    ready: Callable[[], None]
    """Tells the supervisor the models are loaded and warm."""
    wait_for_all: Callable[[], object]
    """Blocks until every worker of the first start-up is warm (at once for a restarted one)."""


@dataclass
class _Slot:
    index: int
    process: SpawnProcess | None = None
    ready: Event | None = None
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    announced: bool = False
    """Its readiness was logged."""


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` server processes until SIGTERM/SIGINT; the process exit code."""
    directory, owned = _metrics_dir()
    try:
        sock = bind_socket(settings.host, settings.port)
        return Supervisor(settings, sock, directory).run()
    finally:
        if owned:
            shutil.rmtree(directory, ignore_errors=True)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT and not yet listening: until ``listen`` the kernel hands
    it no connection (uvicorn listens once the worker's start-up is done)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _metrics_dir() -> tuple[Path, bool]:
    """The folder for the workers' metric files, emptied: an operator's, or a private one.

    Files left by an earlier run would add its counts to this one's.
    """
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        directory = Path(given)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.db"):
            stale.unlink()
        return directory, False
    directory = Path(tempfile.mkdtemp(prefix="nograd-metrics-"))
    # Set before any prometheus_client import here or in a worker: it picks file-backed values
    # once, at import.
    os.environ[MULTIPROC_ENV] = str(directory)
    return directory, True


class Supervisor:
    def __init__(self, settings: Settings, sock: socket.socket, multiprocess_dir: Path) -> None:
        self._settings = settings
        self._sock = sock
        self._port = int(sock.getsockname()[1])
        self._dir = multiprocess_dir
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = [_Slot(i) for i in range(settings.workers)]
        self._stop_signal: int | None = None
        # Set once every worker of the first start-up is warm: they all start listening
        # together, since a client's connections opened while only some workers listened would
        # stay on those for as long as they are kept alive.
        self._go = self._ctx.Event()

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            logger.info(
                "listening on %s:%d with %d worker processes",
                self._settings.host,
                self._port,
                len(self._slots),
            )
            self._serve_metrics()
            for slot in self._slots:
                self._start(slot)
                if not self._wait_ready(slot):
                    return 0 if self._stop_signal is not None else 1
            self._go.set()
            logger.info("all %d workers serve", len(self._slots))
            while self._stop_signal is None:
                self._watch(timeout_s=0.5)
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._sock.close()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        del frame
        if self._stop_signal is None:
            logger.info("%s: stopping the workers", signal.Signals(sig).name)
            self._stop_signal = sig
            return
        # A second signal means "now": a draining uvicorn would still wait for its open
        # connections, so the workers are killed; requests still in flight are cut.
        logger.info("%s again: killing the workers now", signal.Signals(sig).name)
        self._signal_workers(signal.SIGKILL)

    def _signal_workers(self, sig: int) -> None:
        for slot in self._slots:
            process = slot.process
            if process is not None and process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def _serve_metrics(self) -> None:
        if self._settings.metrics_port is None:
            return
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self._dir))  # type: ignore[no-untyped-call]
        start_http_server(self._settings.metrics_port, self._settings.host, registry)
        logger.info("metrics of all workers also served on port %d", self._settings.metrics_port)

    def _start(self, slot: _Slot) -> None:
        slot.ready = self._ctx.Event()
        slot.process = self._ctx.Process(
            target=_worker_main,
            args=(self._settings, self._port, self._dir),
            kwargs={"ready": slot.ready, "go": self._go, "supervisor": os.getpid()},
            name=f"nograd-worker-{slot.index}",
            daemon=False,
        )
        slot.process.start()
        slot.started_at = time.monotonic()
        slot.restart_at = None
        slot.announced = False
        logger.info("worker %d started (pid %s)", slot.index, slot.process.pid)

    def _wait_ready(self, slot: _Slot) -> bool:
        assert slot.process is not None and slot.ready is not None
        while not slot.ready.wait(0.2):
            if self._stop_signal is not None:
                return False
            if not slot.process.is_alive():
                logger.error(
                    "worker %d exited with code %s while starting; stopping the server",
                    slot.index,
                    slot.process.exitcode,
                )
                return False
        self._announce(slot)
        return True

    def _announce(self, slot: _Slot) -> None:
        slot.announced = True
        logger.info("worker %d ready after %.1fs", slot.index, time.monotonic() - slot.started_at)

    def _watch(self, timeout_s: float) -> None:
        """Wait for a worker to exit or a restart to fall due, then handle either."""
        live = [s.process.sentinel for s in self._slots if s.process is not None]
        due = [s.restart_at for s in self._slots if s.restart_at is not None]
        if due:
            timeout_s = max(0.0, min(timeout_s, min(due) - time.monotonic()))
        wait(live, timeout_s)
        if self._stop_signal is not None:
            return
        now = time.monotonic()
        for slot in self._slots:
            if slot.process is not None and not slot.process.is_alive():
                self._buried(slot, now)
            if slot.restart_at is not None and now >= slot.restart_at:
                self._start(slot)
            ready = slot.ready is not None and slot.ready.is_set()
            if slot.process is not None and ready and not slot.announced:
                self._announce(slot)

    def _buried(self, slot: _Slot, now: float) -> None:
        assert slot.process is not None
        pid, code = slot.process.pid, slot.process.exitcode
        slot.process.close()
        slot.process = None
        if pid is not None:
            _mark_dead(pid, self._dir)
        lived = now - slot.started_at
        slot.failures, delay = next_restart(lived, slot.failures)
        slot.restart_at = now + delay
        logger.error(
            "worker %d (pid %s) exited with code %s after %.1fs; starting it again in %.0fs",
            slot.index,
            pid,
            code,
            lived,
            delay,
        )

    def _stop_all(self) -> None:
        running = [s.process for s in self._slots if s.process is not None]
        self._go.set()  # a worker waiting for the others must not wait through its SIGTERM
        self._signal_workers(signal.SIGTERM)
        deadline = time.monotonic() + self._settings.drain_timeout_s + 10.0
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.error("worker pid %s did not stop in time; killing it", process.pid)
                process.kill()
                process.join()
        for slot in self._slots:
            slot.process = None
        logger.info("all workers stopped")


def next_restart(lived_s: float, failures: int) -> tuple[int, float]:
    """(failures so far, delay before the next start) for a worker that died after ``lived_s``.

    A worker that served a while restarts at once; one that keeps dying soon after it starts
    (a bad model, a broken device) waits 1, 2, 4 … up to 30 s, so it cannot spin a core.
    """
    if lived_s >= STABLE_AFTER_S:
        return 0, 0.0
    failures += 1
    return failures, min(RESTART_DELAY_MAX_S, 2.0 ** (failures - 1))


def _mark_dead(pid: int, directory: Path) -> None:
    """Drop a dead worker's live gauges; its counters stay, so totals never go backwards."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


def _worker_main(
    settings: Settings,
    port: int,
    multiprocess_dir: Path,
    *,
    ready: Event,
    go: Event,
    supervisor: int,
) -> None:
    _exit_with_supervisor(supervisor)
    from app.logs import setup_logging

    setup_logging(settings.log_level, settings.log_format)
    from app.main import create_app
    from app.server import build_server

    role = WorkerRole(multiprocess_dir, ready.set, go.wait)
    server = build_server(settings, create_app(settings, worker=role))
    server.run(sockets=[bind_socket(settings.host, port)])
    sys.exit(0 if server.started else STARTUP_FAILURE)


def _exit_with_supervisor(supervisor: int) -> None:
    """Ask Linux for SIGTERM when the supervisor dies, so a killed supervisor leaves no worker
    serving its port unsupervised."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
