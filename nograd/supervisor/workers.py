"""Several server processes on one port (``NOGRAD_WORKERS`` > 1; the default, ``auto``, plans two
on a CPU machine with two usable cores, see ``auto_workers``).

One nograd process is bound by Python's GIL: for a small model the event loop, JSON and the
batcher's bookkeeping fill one core while the forward needs little, so a second core idles. Here
a supervisor process starts that many workers (spawned, so none inherits torch or OpenMP state);
each is a whole nograd server with its own models, batchers and device thread.

- The supervisor listens on the port and hands every connection it accepts to the worker with
  the fewest open connections (ties in turn), passing the socket over a Unix socket pair. Two
  ways of letting the kernel spread connections were measured first and dropped: one shared
  listening socket (an idle worker's event loop accepted a whole burst at once, so a client's 32
  connections could all land on one worker) and one ``SO_REUSEPORT`` socket per worker (the
  kernel hashes each connection to a worker: 32 connections split as unevenly as 10/22, at least
  20/12 about one time in five, and the busier worker's queue sets the tail latency). Handing
  over costs one ``sendmsg`` per connection, not per request.
- Workers start one after another (start-up work never competes for the cores); the supervisor
  starts listening once all are warm, and a restarted worker is handed connections once it is
  warm. Each budgets an equal share of the device memory it finds free.
- CPU cores for torch are shared batch by batch through a ledger file in the metrics folder
  (``nograd.host.ledger``): a lone busy worker's batch runs on every core, busy workers on their
  share. The supervisor creates it and clears a dead worker's slot.
- Connections stay with the worker they were handed to: requests on one keep-alive connection
  are served by one worker. A connection handed to a worker just as it dies is reset.
- Metrics live in files in one folder (prometheus_client's multiprocess mode), so /metrics on any
  worker, and ``NOGRAD_METRICS_PORT`` on the supervisor, report the whole server; so do the V2
  statistics (``nograd.observability.stats``), from files of their own in the same folder.
- SIGTERM (or Ctrl+C) reaches every worker as SIGTERM: each drains as a single server does while
  the supervisor keeps handing them connections (answered 503, as a draining server does); a
  second signal kills the workers at once, cutting the requests still in flight. A worker that
  dies while serving is started again, after a delay that grows while it keeps dying; one that
  dies during the first start-up stops the server, as a failed single server would.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from types import FrameType

from nograd.host.ledger import CoreShare, clear_slot, create_ledger
from nograd.host.readings import HostMemory, gpu_visible, resident_bytes, usable_cores
from nograd.settings import Settings

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STATS_PREFIX = "v2stats_"
"""Workers' V2 statistics files in the metrics folder (``nograd.observability.stats``), next to the
metric files."""
CORES_FILE = "cores.i64"
"""The shared ledger of CPU cores (``nograd.host.ledger``), in the metrics folder."""
STARTUP_FAILURE = 3
"""Exit code of a worker whose start-up failed (uvicorn's own code for it)."""
RESTART_DELAY_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A worker that served this long before dying is restarted at once."""
BACKLOG = 2048
"""Connections the kernel queues for the supervisor to accept (uvicorn's default backlog)."""
_ACCEPTS_PER_ROUND = 256
"""Accepted in one go before the supervisor looks at its workers again."""
ACCEPT_RETRY_S = 1.0
"""Pause after accept itself fails (out of file descriptors): the queued connection stays
readable, so accepting again at once would spin a core (asyncio waits as long)."""


@dataclass(frozen=True)
class WorkerRole:
    """What one worker process knows of the others."""

    multiprocess_dir: Path
    ready: Callable[[], None]
    """Tells the supervisor the models are loaded and warm."""
    cores: CoreShare | None = None
    """This worker's slot in the ledger of CPU cores the workers share (``share_cores``)."""


@dataclass(frozen=True)
class Handoff:
    """A worker's end of the way connections reach it from the supervisor."""

    channel: socket.socket
    """Unix SOCK_SEQPACKET socket: one message per connection, the socket passed along."""
    closed: ctypes.c_longlong
    """Shared with the supervisor: connections this worker has closed so far."""


@dataclass
class _Slot:
    index: int
    process: SpawnProcess | None = None
    ready: Event | None = None
    channel: socket.socket | None = None
    """The supervisor's end of the worker's Handoff channel."""
    closed: ctypes.c_longlong | None = None
    sent: int = 0
    """Connections handed to this worker; with ``closed``, the ones it has open."""
    serving: bool = False
    """Warm and handed connections."""
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    resident: int | None = None
    """Resident memory (bytes) when the worker last became ready; None if unreadable."""


AUTO_MAX_WORKERS = 2
"""``NOGRAD_WORKERS=auto`` starts at most this many: measured on 2 cores, where the second
process roughly doubled a small model's requests/s; above that, memory grows with every copy
while the gain is unmeasured, so more is an explicit choice."""
AUTO_MEMORY_SHARE = 0.8
"""``auto`` starts another worker only if the first one's resident memory fits in this share
of the memory still available (the rest is left for the batches and the page cache)."""


def auto_workers(cores: int, gpu: bool, torch_threads: int | None = None) -> tuple[int, str]:
    """How many workers ``NOGRAD_WORKERS=auto`` plans, and why (for the start-up log).

    A fixed ``NOGRAD_TORCH_THREADS`` is every worker's count: workers are then limited to as
    many as the cores hold at that count, so torch's threads never outnumber the cores.
    """
    if gpu:
        # Each worker would hold a CUDA context and a copy of the weights on the same device.
        return 1, "a GPU is visible"
    plural = "s" if cores != 1 else ""
    reason = f"{cores} usable CPU core{plural}, no GPU"
    room = cores
    if torch_threads is not None:
        room = cores // torch_threads
        reason += f", NOGRAD_TORCH_THREADS={torch_threads} per worker"
    return max(1, min(room, AUTO_MAX_WORKERS)), reason


def auto_plan(torch_threads: int | None = None) -> tuple[int, str]:
    """``auto_workers`` for this process: its usable cores and the GPUs it can see."""
    return auto_workers(usable_cores(), gpu_visible(), torch_threads)


def resolve_workers(settings: Settings) -> tuple[Settings, bool]:
    """``settings`` with ``workers`` a number, and whether it was planned by ``auto`` (then
    workers after the first are started only while another copy of the models fits)."""
    if settings.workers != "auto":
        return settings, False
    count, reason = auto_plan(settings.torch_threads)
    logger.info("workers: auto, %d (%s)", count, reason)
    return settings.model_copy(update={"workers": count}), True


def supervise(settings: Settings, *, fit_to_memory: bool = False) -> int:
    """Run ``settings.workers`` server processes until SIGTERM/SIGINT; the process exit code.
    ``fit_to_memory``: start a worker after the first only if another copy fits in memory."""
    directory, owned = _metrics_dir()
    try:
        sock = bind_socket(settings.host, settings.port)
        return Supervisor(settings, sock, directory, fit_to_memory=fit_to_memory).run()
    finally:
        if owned:
            shutil.rmtree(directory, ignore_errors=True)


def bind_socket(host: str, port: int) -> socket.socket:
    """The port, bound and not yet listening: until ``listen`` (once the workers are warm) the
    kernel refuses connections rather than queueing them for a server that cannot answer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def least_loaded(open_connections: Sequence[int | None], last: int) -> int | None:
    """The worker to hand the next connection: fewest open connections, ties taken in turn
    after ``last`` (so one-request connections alternate); None marks a worker not serving."""
    count = len(open_connections)
    best: int | None = None
    best_load = 0
    for step in range(1, count + 1):
        index = (last + step) % count
        load = open_connections[index]
        if load is not None and (best is None or load < best_load):
            best, best_load = index, load
    return best


def _metrics_dir() -> tuple[Path, bool]:
    """The folder for the workers' metric and statistics files, emptied: an operator's, or a
    private one.

    Files left by an earlier run would add its counts to this one's.
    """
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        directory = Path(given)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in (*directory.glob("*.db"), *directory.glob(f"{STATS_PREFIX}*")):
            stale.unlink()
        return directory, False
    directory = Path(tempfile.mkdtemp(prefix="nograd-metrics-"))
    # Set before any prometheus_client import here or in a worker: it picks file-backed values
    # once, at import.
    os.environ[MULTIPROC_ENV] = str(directory)
    return directory, True


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        sock: socket.socket,
        multiprocess_dir: Path,
        *,
        fit_to_memory: bool = False,
        host: HostMemory | None = None,
    ) -> None:
        self._settings = settings
        self._fit_to_memory = fit_to_memory
        self._host = host or HostMemory()
        self._sock = sock
        self._port = int(sock.getsockname()[1])
        self._dir = multiprocess_dir
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = [_Slot(i) for i in range(settings.worker_count)]
        self._stop_signal: int | None = None
        self._listening = False
        self._closing = False
        """Stopping (a stop signal came, or the workers are being stopped): dead workers are
        not started again."""
        self._last_pick = -1
        self._dropped = 0
        self._accept_resume_at = 0.0
        self._cores: Path | None = None
        """The ledger of shared CPU cores, created when the workers start (``share_cores``)."""
        if settings.share_cores and settings.torch_threads is None:
            self._cores = multiprocess_dir / CORES_FILE

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self._serve_metrics()
            if self._cores is not None:
                create_ledger(self._cores, len(self._slots))
            if not self._start_all():
                return 0 if self._stop_signal is not None else 1
            # Listening only once every worker is warm: a client's connections opened while
            # some workers were still loading would stay on the others while kept alive.
            self._sock.setblocking(False)
            self._sock.listen(BACKLOG)
            self._listening = True
            logger.info(
                "listening on %s:%d with %d worker processes",
                self._settings.host,
                self._port,
                len(self._slots),
            )
            while self._stop_signal is None:
                self._watch(timeout_s=0.5)
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._sock.close()
            for slot in self._slots:
                self._close_channel(slot)

    def _start_all(self) -> bool:
        """Start the workers one after another, each once the one before is warm; False when
        one failed or a stop signal came first."""
        for slot in list(self._slots):
            if slot.index > 0 and self._fit_to_memory and not self._another_fits(slot.index):
                del self._slots[slot.index :]
                break
            self._start(slot)
            if not self._wait_ready(slot):
                return False
        return True

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        del frame
        if self._stop_signal is None:
            logger.info("%s: stopping the workers", signal.Signals(sig).name)
            self._stop_signal = sig
            self._closing = True
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
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        closed = self._ctx.RawValue(ctypes.c_longlong, 0)
        slot.process = self._ctx.Process(
            target=_worker_main,
            args=(self._settings, self._dir),
            kwargs={
                "ready": slot.ready,
                "handoff": Handoff(theirs, closed),
                "supervisor": os.getpid(),
                "cores": None if self._cores is None else CoreShare(self._cores, slot.index),
            },
            name=f"nograd-worker-{slot.index}",
            daemon=False,
        )
        slot.process.start()
        theirs.close()
        slot.channel, slot.closed, slot.sent = ours, closed, 0
        slot.started_at = time.monotonic()
        slot.restart_at = None
        slot.serving = False
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
        self._serve(slot)
        return True

    def _serve(self, slot: _Slot) -> None:
        slot.serving = True
        pid = slot.process.pid if slot.process is not None else None
        slot.resident = None if pid is None else resident_bytes(pid)
        logger.info(
            "worker %d ready after %.1fs, %s resident",
            slot.index,
            time.monotonic() - slot.started_at,
            _gigabytes(slot.resident),
        )

    def _another_fits(self, started: int) -> bool:
        """Whether one more copy of the first worker, as measured warm, fits in the memory left.
        Without it a second worker on a tight memory limit would be OOM-killed during start-up,
        which stops the whole server; one worker serves instead."""
        footprint = self._slots[0].resident
        available = self._host.available_bytes()
        if footprint is None or footprint <= AUTO_MEMORY_SHARE * available:
            return True
        logger.warning(
            "workers: auto, serving with %d: another worker would hold %s more (the first one's "
            "resident memory) and %s is available, of which %.0f%% may go to it; set "
            "NOGRAD_WORKERS to choose",
            started,
            _gigabytes(footprint),
            _gigabytes(available),
            AUTO_MEMORY_SHARE * 100,
        )
        return False

    def _watch(self, timeout_s: float) -> None:
        """Wait for a connection, a worker's exit or a due restart, then handle each."""
        live = [s.process.sentinel for s in self._slots if s.process is not None]
        due = [s.restart_at for s in self._slots if s.restart_at is not None]
        accepting = self._accepting()
        if not accepting and self._listening:
            due.append(self._accept_resume_at)
        if due:
            timeout_s = max(0.0, min(timeout_s, min(due) - time.monotonic()))
        # Only a listening socket: one that is merely bound polls as hung up, always ready.
        wait([*live, self._sock] if accepting else live, timeout_s)
        self._bury_dead()
        self._hand_over()
        if self._closing:
            return
        now = time.monotonic()
        for slot in self._slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                self._start(slot)
            ready = slot.ready is not None and slot.ready.is_set()
            if slot.process is not None and ready and not slot.serving:
                self._serve(slot)

    def _bury_dead(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if slot.process is not None and not slot.process.is_alive():
                self._buried(slot, now)

    def _hand_over(self) -> None:
        """Accept waiting connections and hand each to the least busy serving worker."""
        if not self._accepting():
            return
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # reset by its client while queued
                continue
            except OSError as exc:  # out of file descriptors or memory
                logger.warning(
                    "accepting a connection failed: %s; accepting again in %.0fs",
                    exc,
                    ACCEPT_RETRY_S,
                )
                self._accept_resume_at = time.monotonic() + ACCEPT_RETRY_S
                return
            with conn:
                if not self._send(conn):
                    self._dropped += 1
                    logger.warning(
                        "no worker could take a connection; closed it (%d so far)", self._dropped
                    )

    def _accepting(self) -> bool:
        return self._listening and time.monotonic() >= self._accept_resume_at

    def _send(self, conn: socket.socket) -> bool:
        tried: set[int] = set()
        while True:
            loads = [
                self._open_connections(s) if s.index not in tried else None for s in self._slots
            ]
            index = least_loaded(loads, self._last_pick)
            if index is None:
                return False
            slot = self._slots[index]
            assert slot.channel is not None
            try:
                socket.send_fds(slot.channel, [b"c"], [conn.fileno()])
            except BlockingIOError:
                tried.add(index)  # its inbox is full: the worker is stuck; try another
                continue
            except OSError:
                tried.add(index)  # its end is closed: the worker is exiting or gone
                slot.serving = False
                continue
            slot.sent += 1
            self._last_pick = index
            return True

    @staticmethod
    def _open_connections(slot: _Slot) -> int | None:
        # A serving slot always has its channel and counter (_close_channel clears all three).
        if not slot.serving or slot.closed is None:
            return None
        return slot.sent - slot.closed.value

    def _close_channel(self, slot: _Slot) -> None:
        if slot.channel is not None:
            slot.channel.close()
        slot.channel, slot.closed, slot.serving = None, None, False

    def _buried(self, slot: _Slot, now: float) -> None:
        assert slot.process is not None
        pid, code = slot.process.pid, slot.process.exitcode
        slot.process.close()
        slot.process = None
        self._close_channel(slot)
        if pid is not None:
            _mark_dead(pid, self._dir)
        if self._cores is not None:
            clear_slot(self._cores, slot.index)
        if self._closing:
            # Ctrl+C in a terminal signals the whole process group: a worker may finish its
            # own drain before the supervisor's stop reaches it. That is the stop, not a crash.
            logger.info("worker %d (pid %s) stopped with code %s", slot.index, pid, code)
            return
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
        """SIGTERM every worker and wait for them; connections arriving meanwhile are still
        handed to the workers that drain (they answer 503, as a draining server does)."""
        self._closing = True
        self._signal_workers(signal.SIGTERM)
        deadline = time.monotonic() + self._settings.drain_timeout_s + 10.0
        while any(s.process is not None for s in self._slots) and time.monotonic() < deadline:
            self._watch(timeout_s=max(0.0, min(0.5, deadline - time.monotonic())))
        for slot in self._slots:
            if slot.process is not None:
                logger.error("worker pid %s did not stop in time; killing it", slot.process.pid)
                slot.process.kill()
                slot.process.join()
                self._buried(slot, time.monotonic())
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


def _gigabytes(value: int | None) -> str:
    return "?" if value is None else f"{value / 1e9:.2f} GB"


def _mark_dead(pid: int, directory: Path) -> None:
    """Drop a dead worker's live gauges; its counters stay, so totals never go backwards."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


def _worker_main(
    settings: Settings,
    multiprocess_dir: Path,
    *,
    ready: Event,
    handoff: Handoff,
    supervisor: int,
    cores: CoreShare | None,
) -> None:
    # Ctrl+C in a terminal reaches every process of the group. The supervisor turns it into
    # SIGTERM for each worker; uvicorn still drains on the SIGINT it catches while serving, but
    # re-raised after the drain (or arriving during imports) it would end the worker with a
    # KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_supervisor(supervisor)
    from nograd.observability.logs import setup_logging

    setup_logging(settings.log_level, settings.log_format)
    from nograd.http.app import create_app
    from nograd.http.server import build_server

    role = WorkerRole(multiprocess_dir, ready.set, cores)
    server = build_server(settings, create_app(settings, worker=role), handoff=handoff)
    server.run()
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
