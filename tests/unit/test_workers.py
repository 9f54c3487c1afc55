"""The worker supervisor's pieces that need no processes: restart back-off, socket binding,
and metrics that refuse to run multiprocess without file-backed values."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from app.metrics import Metrics
from app.workers import RESTART_DELAY_MAX_S, STABLE_AFTER_S, bind_socket, next_restart


def test_a_worker_that_served_long_restarts_at_once() -> None:
    assert next_restart(lived_s=STABLE_AFTER_S, failures=5) == (0, 0.0)


def test_a_worker_that_keeps_dying_waits_longer_each_time_up_to_a_cap() -> None:
    failures, delays = 0, []
    for _ in range(8):
        failures, delay = next_restart(lived_s=2.0, failures=failures)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, RESTART_DELAY_MAX_S, RESTART_DELAY_MAX_S, 30.0]
    assert failures == 8


def test_worker_sockets_share_a_port_and_take_no_connection_before_listening() -> None:
    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = bind_socket("127.0.0.1", port)  # SO_REUSEPORT: a second worker binds the same port
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        second.listen()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        first.close()
        second.close()


def test_multiprocess_metrics_need_the_directory_set_before_import(tmp_path: Path) -> None:
    # This test process imported prometheus_client without PROMETHEUS_MULTIPROC_DIR: its values
    # live in memory, and a worker built so would count only for itself.
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        Metrics(multiprocess_dir=tmp_path)
