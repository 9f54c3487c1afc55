"""The supervisor's pieces that need no worker processes: restart back-off, handing connections
to the least busy worker, the memory check for a second worker, and metrics that refuse to run
multiprocess without file-backed values; and the order in which real worker processes (serving
nothing) import and load."""

from __future__ import annotations

import ctypes
import errno
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nograd.observability.metrics import Metrics
from nograd.settings import Settings
from nograd.supervisor import supervisor as supervisor_module
from nograd.supervisor.handoff import HTTP, bind_socket
from nograd.supervisor.slots import RESTART_DELAY_MAX_S, STABLE_AFTER_S, Slot, next_restart
from nograd.supervisor.supervisor import Supervisor
from tests.unit.supervisor.start_order import MARKS_ENV

SERVE = "tests.never:imported"
"""No worker process is started here: the serving function is never imported."""


def test_a_worker_that_served_long_restarts_at_once() -> None:
    assert next_restart(lived_s=STABLE_AFTER_S, failures=5) == (0, 0.0)


def test_a_worker_that_keeps_dying_waits_longer_each_time_up_to_a_cap() -> None:
    failures, delays = 0, []
    for _ in range(8):
        failures, delay = next_restart(lived_s=2.0, failures=failures)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, RESTART_DELAY_MAX_S, RESTART_DELAY_MAX_S, 30.0]
    assert failures == 8


def test_cores_are_shared_unless_turned_off_fixed_or_under_on_demand_control() -> None:
    def ledger(**settings: object) -> Path | None:
        sock = bind_socket("127.0.0.1", 0)
        try:
            supervisor = Supervisor(
                Settings(workers=2, **settings), SERVE, {HTTP: sock}, Path("/tmp/m")
            )  # type: ignore[arg-type]
            return supervisor._cores
        finally:
            sock.close()

    assert ledger() == Path("/tmp/m/cores.i64")
    assert ledger(share_cores=False) is None
    assert ledger(torch_threads=1) is None
    # An ONNX model would hold a session per width where memory limits how many models fit.
    assert ledger(model_control="on_demand") is None


class Workers:
    """A supervisor over a real listening port whose workers are the test's socket pairs."""

    def __init__(self, count: int) -> None:
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.supervisor = Supervisor(
            Settings(workers=count), SERVE, {HTTP: self.sock}, Path("/nonexistent")
        )
        self.inboxes: list[socket.socket] = []
        self.closed: list[ctypes.c_longlong] = []
        for slot in self.supervisor._slots:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.setblocking(False)
            theirs.setblocking(False)
            closed = ctypes.c_longlong(0)
            slot.channel, slot.closed, slot.serving = ours, closed, True
            self.inboxes.append(theirs)
            self.closed.append(closed)
        self.sock.setblocking(False)
        self.sock.listen()
        self.supervisor._listening = True
        self.clients: list[socket.socket] = []

    @property
    def slots(self) -> list[Slot]:
        return self.supervisor._slots

    def connect(self, count: int) -> None:
        for _ in range(count):
            self.clients.append(socket.create_connection(("127.0.0.1", self.port), timeout=2))
        # Let the kernel finish the handshakes, then hand over everything that is queued.
        for _ in range(50):
            self.supervisor._hand_over()
            handled = sum(s.sent for s in self.slots) + self.supervisor._refusals.count
            if handled >= len(self.clients):
                return
            time.sleep(0.01)
        raise AssertionError("connections were not handed over")

    def received(self, index: int) -> list[socket.socket]:
        """The connections waiting in one worker's inbox, as the worker would take them."""
        conns = []
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self.inboxes[index], 1, 1)
            except BlockingIOError:
                return conns
            conns.extend(socket.socket(fileno=fd) for fd in fds)

    def close(self) -> None:
        for sock in [self.sock, *self.inboxes, *self.clients]:
            sock.close()
        for slot in self.slots:
            self.supervisor._close_channel(slot)


class OutOfDescriptors:
    """A listening socket whose accept fails as when the process has no file descriptor left."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.accepts = 0

    def accept(self) -> tuple[socket.socket, object]:
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


@pytest.fixture
def workers() -> Iterator[Workers]:
    made = Workers(2)
    yield made
    made.close()


def test_a_burst_of_connections_is_split_evenly(workers: Workers) -> None:
    workers.connect(32)
    first, second = workers.received(0), workers.received(1)
    assert (len(first), len(second)) == (16, 16)
    # What a worker receives is the client's connection itself.
    first[0].sendall(b"hello")
    replies = [c for c in workers.clients if c.getsockname() == first[0].getpeername()]
    assert len(replies) == 1 and replies[0].recv(5) == b"hello"
    for conn in first + second:
        conn.close()


def test_a_worker_that_closed_connections_gets_the_next_ones(workers: Workers) -> None:
    workers.connect(8)
    workers.closed[1].value = 4  # worker 1 served its four and closed them
    workers.connect(6)
    # Worker 1 takes four to catch up with worker 0's four open, then ties alternate.
    assert [s.sent for s in workers.slots] == [5, 9]


def test_a_worker_whose_channel_is_gone_is_skipped(workers: Workers) -> None:
    workers.inboxes[0].close()  # the worker died or shut down
    workers.connect(4)
    assert [s.sent for s in workers.slots] == [0, 4]
    assert not workers.slots[0].serving
    assert len(workers.received(1)) == 4


def test_with_no_worker_serving_a_connection_is_answered_503_not_cut(workers: Workers) -> None:
    for slot in workers.slots:
        slot.serving = False
    workers.connect(1)
    client = workers.clients[0]
    # The request, sent before the supervisor answered, is read and dropped: closing the
    # connection with it unread would reset it and could destroy the answer.
    client.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    assert workers.supervisor._refusals.count == 1
    answer = b""
    while chunk := client.recv(65536):
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"retry-after: 1" in head and b"connection: close" in head
    assert b"retry later" in body
    client.close()  # the client's close ends the supervisor's lingering read
    deadline = time.monotonic() + 2
    while workers.supervisor._refusals.sockets:
        assert time.monotonic() < deadline
        workers.supervisor._watch(timeout_s=0.1)


def test_a_stop_hands_over_every_queued_connection_before_closing_the_port(
    workers: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor_module, "_ACCEPTS_PER_ROUND", 2)
    for _ in range(5):
        workers.clients.append(socket.create_connection(("127.0.0.1", workers.port), timeout=2))
    time.sleep(0.05)  # the handshakes done: all five queued in the kernel
    workers.supervisor._stop_listening()
    handed = 0
    for inbox in workers.inboxes:
        # Every connection sent before the supervisor ended the channel, then its end.
        while socket.recv_fds(inbox, 1, 1)[1]:
            handed += 1
    assert handed == 5


def test_multiprocess_metrics_need_the_directory_set_before_import(tmp_path: Path) -> None:
    # This test process imported prometheus_client without PROMETHEUS_MULTIPROC_DIR: its values
    # live in memory, and a worker built so would count only for itself.
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        Metrics(multiprocess_dir=tmp_path)


def test_a_failing_accept_pauses_accepting_instead_of_spinning(
    workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    failing = OutOfDescriptors(workers.sock)
    workers.supervisor._sockets[HTTP] = failing  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, "nograd.supervisor.supervisor"):
        workers.supervisor._hand_over()
        workers.supervisor._hand_over()  # within the pause: accept is not tried again
    assert failing.accepts == 1
    assert "Too many open files; accepting again in 1s" in caplog.text
    # A connection waits in the queue, so the port polls readable: the supervisor must still
    # sleep out its pause rather than wake for it over and over.
    workers.clients.append(socket.create_connection(("127.0.0.1", workers.port), timeout=2))
    started = time.monotonic()
    workers.supervisor._watch(timeout_s=0.3)
    assert time.monotonic() - started >= 0.25
    assert failing.accepts == 1


def test_a_worker_that_exits_after_the_stop_signal_is_not_started_again(
    workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    # Ctrl+C in a terminal reaches the workers too (one process group): one may be gone before
    # the supervisor stops it. Before, that logged an error and scheduled a restart mid-stop.
    slot = workers.slots[0]
    process = multiprocessing.get_context("spawn").Process(target=os._exit, args=(0,))
    process.start()
    process.join()
    slot.process = process
    with caplog.at_level(logging.INFO, "nograd.supervisor.supervisor"):
        workers.supervisor._on_signal(signal.SIGINT, None)
        workers.supervisor._bury_dead()
    assert slot.process is None
    assert slot.restart_at is None
    assert "starting it again" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class FixedMemory:
    def __init__(self, available: int) -> None:
        self.available = available

    def available_bytes(self) -> int:
        return self.available


class Started:
    """Stands in for a warm worker process: this test process, whose memory is real."""

    pid = os.getpid()


@pytest.mark.parametrize(("available_gb", "started"), [(1000, 2), (0.001, 1)])
def test_auto_starts_a_second_worker_only_if_another_copy_fits_in_memory(
    available_gb: float, started: int, caplog: pytest.LogCaptureFixture
) -> None:
    sock = bind_socket("127.0.0.1", 0)
    supervisor = Supervisor(
        Settings(workers=2),
        SERVE,
        {HTTP: sock},
        Path("/nonexistent"),
        fit_to_memory=True,
        host=FixedMemory(int(available_gb * 1e9)),  # type: ignore[arg-type]
    )
    starts: list[int] = []

    def start(slot: Slot, after: object = None) -> None:
        assert after is None  # each is started once the one before is warm
        starts.append(slot.index)
        slot.process = Started()  # type: ignore[assignment]

    supervisor._start = start  # type: ignore[method-assign]

    def ready(slot: Slot) -> bool:
        supervisor._mark_serving(slot)  # as a warm worker does: its resident memory is read
        return True

    supervisor._wait_ready = ready  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, "nograd.supervisor.supervisor"):
            assert supervisor._start_all()
    finally:
        sock.close()
    assert starts == list(range(started))
    assert len(supervisor._slots) == started
    if started == 1:
        assert "workers: auto, serving with 1: another worker would hold" in caplog.text
    else:
        assert caplog.text == ""


def test_workers_import_at_once_and_load_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real worker processes (``tests.unit.supervisor.start_order``): the first one's load
    finishes only once both have imported their serving code, and the second loads only once
    the first is warm."""
    monkeypatch.setenv(MARKS_ENV, str(tmp_path))
    sock = bind_socket("127.0.0.1", 0)
    supervisor = Supervisor(
        Settings(workers=2, share_cores=False),
        "tests.unit.supervisor.start_order:serve",
        {HTTP: sock},
        tmp_path,
    )
    try:
        assert supervisor._start_all()
    finally:
        supervisor._stop_all()
        sock.close()

    def at(name: str) -> float:
        return float((tmp_path / name).read_text())

    assert len(list(tmp_path.glob("imported-*[0-9]"))) == 2
    assert at("loading-1") >= at("ready-0")
