"""The supervisor: several worker processes serving one port (``NOGRAD_WORKERS`` > 1).

One nograd process is bound by Python's GIL: for a small model the event loop, JSON and the
batcher's bookkeeping fill one core while the forward needs little. The supervisor starts that
many workers (spawned, so none inherits torch or OpenMP state); each is a whole nograd server with
its own models, batchers and device thread.

- The supervisor listens on the port and hands every connection to the least busy worker
  (``nograd.supervisor.handoff``); connections stay with the worker they were handed to.
- Workers start at once and load their models one after another: their imports (seconds of
  CPU each) overlap, their loads never compete for the cores. The supervisor listens once all
  are warm, and hands a restarted worker connections once it is warm.
- CPU cores for torch are shared batch by batch through a ledger in the shared folder
  (``nograd.host.ledger``): the supervisor creates it and clears a dead worker's slot.
- Only the supervisor listens to SIGTERM and SIGINT (``nograd.supervisor.stopping``): workers
  ignore them, so a signal to the whole process group is one stop. The supervisor tells every
  worker to drain (``DRAIN_SIGNAL``); each drains as a single server does while the supervisor
  keeps handing them connections (answered 503). A later Ctrl+C kills them. A worker that dies
  while serving is started again, after a delay that grows while it keeps dying; one that dies
  during the first start-up stops the server, as a failed single server would.

It imports no torch: the supervisor stays small, and only workers load models.
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
import time
from collections.abc import Mapping
from multiprocessing.connection import wait
from multiprocessing.synchronize import Event
from pathlib import Path
from types import FrameType

from nograd.host.ledger import CoreShare, clear_slot, create_ledger
from nograd.host.readings import HostMemory, process_age_s, resident_bytes
from nograd.settings import Settings
from nograd.supervisor.handoff import QUIET, Handoff, bind_ports, describe_ports
from nograd.supervisor.plan import another_fits, gigabytes
from nograd.supervisor.refusal import Refusals
from nograd.supervisor.shared_dir import (
    CORES_FILE,
    engine_socket_path,
    mark_dead,
    prepare_shared_dir,
    serve_metrics,
)
from nograd.supervisor.slots import Slot, describe_processes, hand_to, next_restart, plan_slots
from nograd.supervisor.stopping import DRAIN_SIGNAL, STOP_SIGNALS, StopSignals, Verdict, describe
from nograd.supervisor.worker import worker_main

logger = logging.getLogger(__name__)

BACKLOG = 2048
"""Connections the kernel queues for the supervisor to accept (uvicorn's default backlog)."""
_ACCEPTS_PER_ROUND = 256
"""Accepted in one go before the supervisor looks at its workers again."""
ACCEPT_RETRY_S = 1.0
"""Pause after accept itself fails (out of file descriptors): the queued connection stays
readable, so accepting again at once would spin a core (asyncio waits as long)."""


def supervise(
    settings: Settings, serve: str, *, fit_to_memory: bool = False, front: str | None = None
) -> int:
    """Run ``settings.workers`` processes, each serving with the function ``serve`` names
    (``"module:function"``, a ``ServeWorker``), until SIGTERM/SIGINT;
    the process exit code. ``fit_to_memory``: start a worker after the first only if another
    copy fits in memory. ``front``: ``serve`` is the engine's, and ``settings.fronts``
    processes serve the HTTP connections with ``front``."""
    try:
        sockets = bind_ports(settings)
    except OSError as exc:
        logger.error("start-up failed: %s", exc)
        return 1
    directory, owned = prepare_shared_dir()
    try:
        return Supervisor(
            settings, serve, sockets, directory, fit_to_memory=fit_to_memory, front=front
        ).run()
    finally:
        if owned:
            shutil.rmtree(directory, ignore_errors=True)


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        serve: str,
        sockets: Mapping[bytes, socket.socket],
        shared_dir: Path,
        *,
        fit_to_memory: bool = False,
        host: HostMemory | None = None,
        front: str | None = None,
    ) -> None:
        self._settings = settings
        self._fit_to_memory = fit_to_memory
        self._host = host or HostMemory()
        self._sockets = dict(sockets)
        """The bound ports by the front their connections are for."""
        self._wakeup = socket.socketpair()
        """Written to by the signal machinery when a signal arrives (``signal.set_wakeup_fd``)."""
        for end in self._wakeup:
            end.setblocking(False)
        self._dir = shared_dir
        self._ctx = multiprocessing.get_context("spawn")
        self._engine_socket = None if front is None else engine_socket_path(shared_dir)
        self._slots = plan_slots(settings, serve, front, frozenset(self._sockets))
        self._stop_signal: int | None = None
        self._stops = StopSignals()
        self._listening = False
        self._closing = False
        """Stopping (a stop signal came, or the workers are being stopped): dead workers are
        not started again."""
        self._last_pick = -1
        self._refusals = Refusals()
        """Connections no worker could take, answered 503 and closing."""
        self._accept_resume_at = 0.0
        self._cores: Path | None = None
        """The ledger of shared CPU cores, created when the workers start (``share_cores``)."""
        if settings.cores_shared and front is None:
            self._cores = shared_dir / CORES_FILE

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        # A stop signal wakes the wait at once (it would otherwise end only at its timeout).
        previous_wakeup = signal.set_wakeup_fd(self._wakeup[1].fileno(), warn_on_full_buffer=False)
        try:
            port = self._settings.metrics_port
            if port is not None:
                serve_metrics(self._dir, self._settings.host, port, self._settings.metrics_keys)
                logger.info("metrics of all workers also served on port %d", port)
            if self._cores is not None:
                create_ledger(self._cores, len(self._slots))
            if not self._start_all():
                return 0 if self._stop_signal is not None else 1
            # Listening only once every worker is warm: a client's connections opened while
            # some workers were still loading would stay on the others while kept alive.
            for sock in self._sockets.values():
                sock.setblocking(False)
                sock.listen(BACKLOG)
            self._listening = True
            logger.info(
                "listening on %s (%s) with %s, %.1fs after the start",
                self._settings.host,
                describe_ports(self._sockets),
                describe_processes(self._slots),
                process_age_s() or 0.0,
            )
            while self._stop_signal is None:
                self._watch(timeout_s=0.5)
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_wakeup)
            for sock in self._wakeup:
                sock.close()
            for sock in self._sockets.values():
                sock.close()
            for slot in self._slots:
                self._close_channel(slot)
            self._refusals.close()

    def _start_all(self) -> bool:
        """Start every worker at once, each loading once the one before is warm; with
        ``fit_to_memory``, start each only once the one before is warm and another copy of the
        models fits. An engine and its fronts start all at once: the fronts load nothing and
        connect once the engine listens. False when one failed or a stop signal came first."""
        if self._engine_socket is not None or not self._fit_to_memory:
            after = None  # the fronts load nothing: none waits for the engine
            for slot in self._slots:
                self._start(slot, after)
                if self._engine_socket is None:
                    after = slot.ready
            return all(self._wait_ready(slot) for slot in self._slots)
        for slot in list(self._slots):
            if slot.index > 0 and not self._another_fits(slot.index):
                del self._slots[slot.index :]
                break
            self._start(slot)
            if not self._wait_ready(slot):
                return False
        return True

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        del frame
        verdict = self._stops.receive(sig)
        logger.info("%s", describe(sig, verdict))
        if verdict is Verdict.DRAIN:
            self._stop_signal = sig
            self._closing = True
        elif verdict is Verdict.FORCE:
            # A draining uvicorn would still wait for its open connections, so the workers are
            # killed; requests still in flight are cut.
            logger.info("killing the workers now")
            self._signal_workers(signal.SIGKILL)

    def _signal_workers(self, sig: int) -> None:
        for slot in self._slots:
            process = slot.process
            if process is not None and process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def _start(self, slot: Slot, after: Event | None = None) -> None:
        """Start ``slot``'s process; it loads its models once ``after`` (the ready event of the
        worker before it) is set."""
        slot.ready = self._ctx.Event()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        closed = self._ctx.RawValue(ctypes.c_longlong, 0)
        slot.process = self._ctx.Process(
            target=worker_main,
            args=(slot.serve, self._settings, self._dir),
            kwargs={
                "ready": slot.ready,
                "handoff": Handoff(theirs, closed),
                "supervisor": os.getpid(),
                "cores": None if self._cores is None else CoreShare(self._cores, slot.index),
                "index": slot.index,
                "engine_socket": self._engine_socket,
                "after": after,
            },
            name=f"nograd-{slot.name.replace(' ', '-')}",
            daemon=False,
        )
        slot.process.start()
        theirs.close()
        slot.channel, slot.closed, slot.sent = ours, closed, 0
        slot.started_at = time.monotonic()
        slot.restart_at = None
        slot.serving = False
        slot.quiet = False
        logger.info("%s started (pid %s)", slot.name, slot.process.pid)

    def _wait_ready(self, slot: Slot) -> bool:
        assert slot.process is not None and slot.ready is not None
        while not slot.ready.wait(0.2):
            if self._stop_signal is not None:
                return False
            if not slot.process.is_alive():
                logger.error(
                    "%s exited with code %s while starting; stopping the server",
                    slot.name,
                    slot.process.exitcode,
                )
                return False
        self._mark_serving(slot)
        return True

    def _mark_serving(self, slot: Slot) -> None:
        slot.serving = True
        pid = slot.process.pid if slot.process is not None else None
        slot.resident = None if pid is None else resident_bytes(pid)
        logger.info(
            "%s ready after %.1fs, %s resident",
            slot.name,
            time.monotonic() - slot.started_at,
            gigabytes(slot.resident),
        )

    def _another_fits(self, started: int) -> bool:
        """Whether one more copy of the first worker, as measured warm, fits in the memory left.
        Without it a second worker on a tight memory limit would be OOM-killed during start-up,
        which stops the whole server; one worker serves instead."""
        return another_fits(self._slots[0].resident, self._host.available_bytes(), started)

    def _watch(self, timeout_s: float) -> None:
        """Wait for a connection, a worker's exit or a due restart, then handle each."""
        live = [s.process.sentinel for s in self._slots if s.process is not None]
        due = [s.restart_at for s in self._slots if s.restart_at is not None]
        accepting = self._accepting()
        if not accepting and self._listening:
            due.append(self._accept_resume_at)
        due += self._refusals.deadlines
        if due:
            timeout_s = max(0.0, min(timeout_s, min(due) - time.monotonic()))
        # Only a listening socket: one that is merely bound polls as hung up, always ready.
        waited: list[object] = [*live, self._wakeup[0], *self._refusals.sockets]
        if accepting:
            waited += self._sockets.values()
        if self._closing:
            waited += [s.channel for s in self._slots if s.channel is not None]
        wait(waited, timeout_s)  # type: ignore[arg-type]
        with contextlib.suppress(BlockingIOError):
            while self._wakeup[0].recv(64):
                pass
        self._bury_dead()
        self._hand_over()
        self._refusals.read()
        if self._closing:
            self._read_reports()
            return
        now = time.monotonic()
        for slot in self._slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                self._start(slot)
            ready = slot.ready is not None and slot.ready.is_set()
            if slot.process is not None and ready and not slot.serving:
                self._mark_serving(slot)

    def _bury_dead(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if slot.process is not None and not slot.process.is_alive():
                self._bury(slot, now)

    def _hand_over(self, *, every: bool = False) -> None:
        """Accept waiting connections on each port (``every``: all the kernel queued, else at
        most one round's) and hand each to the least busy serving worker, with the front it is
        for."""
        for front, sock in self._sockets.items():
            if self._accepting():
                self._hand_over_from(sock, front, every=every)

    def _hand_over_from(self, sock: socket.socket, front: bytes, *, every: bool) -> None:
        accepted = 0
        while every or accepted < _ACCEPTS_PER_ROUND:
            accepted += 1
            try:
                conn, _ = sock.accept()
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
            if self._send(conn, front):
                conn.close()  # the worker holds its own copy
            else:
                self._refusals.refuse(conn, front)

    def _accepting(self) -> bool:
        return self._listening and time.monotonic() >= self._accept_resume_at

    def _send(self, conn: socket.socket, front: bytes) -> bool:
        picked = hand_to(self._slots, conn, front, self._last_pick)
        if picked is None:
            return False
        self._last_pick = picked
        return True

    def _close_channel(self, slot: Slot) -> None:
        if slot.channel is not None:
            slot.channel.close()
        slot.channel, slot.closed, slot.serving = None, None, False

    def _bury(self, slot: Slot, now: float) -> None:
        assert slot.process is not None
        pid, code = slot.process.pid, slot.process.exitcode
        slot.process.close()
        slot.process = None
        self._close_channel(slot)
        if pid is not None:
            mark_dead(pid, self._dir)
        if self._cores is not None:
            clear_slot(self._cores, slot.index)
        if self._closing:
            # Stopping: a worker that exits now finished its drain (or was killed by a forced
            # stop, or by its drain signal while still loading). That is the stop, not a crash.
            logger.info("%s (pid %s) stopped with code %s", slot.name, pid, code)
            return
        lived = now - slot.started_at
        slot.failures, delay = next_restart(lived, slot.failures)
        slot.restart_at = now + delay
        logger.error(
            "%s (pid %s) exited with code %s after %.1fs; starting it again in %.0fs",
            slot.name,
            pid,
            code,
            lived,
            delay,
        )

    def _read_reports(self) -> None:
        """Note each draining worker that said it holds no request."""
        for slot in self._slots:
            while slot.channel is not None:
                try:
                    message = slot.channel.recv(16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    message = b""
                if message == QUIET:
                    slot.quiet = True
                    continue
                # Its end closed: the worker is exiting (its exit is watched for), and a closed
                # channel would wake every wait at once.
                self._close_channel(slot)

    def _stop_listening(self) -> None:
        """Hand over every connection the kernel has queued, then close the port: from here on
        new connections are refused, and none the supervisor accepted is left unanswered."""
        if self._listening:
            self._hand_over(every=True)
            self._listening = False
            for sock in self._sockets.values():
                sock.close()
            logger.info("stopped accepting connections")
        for slot in self._slots:
            # Its inbox still reads what was sent before the end; nothing more can reach it.
            self._close_channel(slot)

    def _stop_all(self) -> None:
        """Tell every worker to drain and wait for them. Connections arriving meanwhile are still
        handed to the workers that drain (they answer 503, as a draining server does) until every
        serving worker holds no request; then the port closes and each worker's channel ends, and
        the workers exit once what they hold is answered."""
        self._closing = True
        self._signal_workers(DRAIN_SIGNAL)
        deadline = time.monotonic() + self._settings.drain_timeout_s + 10.0

        def draining() -> bool:
            return any(s.serving and s.process is not None and not s.quiet for s in self._slots)

        while draining() and time.monotonic() < deadline:
            self._watch(timeout_s=max(0.0, min(0.5, deadline - time.monotonic())))
        self._stop_listening()
        while any(s.process is not None for s in self._slots) and time.monotonic() < deadline:
            self._watch(timeout_s=max(0.0, min(0.5, deadline - time.monotonic())))
        for slot in self._slots:
            if slot.process is not None:
                logger.error("worker pid %s did not stop in time; killing it", slot.process.pid)
                slot.process.kill()
                slot.process.join()
                self._bury(slot, time.monotonic())
        logger.info("all workers stopped")
