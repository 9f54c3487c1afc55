"""The fleet's replicas: ``python -m nograd`` processes, each on its own loopback HTTP and gRPC
port with the settings the fleet was started with, each in a session of its own so a stop
reaches its workers too."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from nograd.fleet.state import Replica, alive

HOST: Final = "127.0.0.1"
READY_PATH: Final = "/v2/health/ready"
SETTINGS_PREFIX: Final = "NOGRAD_"
OWN_SETTINGS: Final = ("NOGRAD_HOST", "NOGRAD_PORT", "NOGRAD_GRPC_PORT")
"""What the fleet sets for each replica itself, whatever the environment says."""
ONE_PROCESS: Final = {"NOGRAD_WORKERS": "1", "NOGRAD_FRONTS": "0"}
"""Each replica's process plan unless the environment names one: the replicas are the fleet's
parallelism, so each is one process (neither workers nor an engine with fronts of its own)."""


class ReplicaError(RuntimeError):
    """A replica exited or did not become ready in time."""


def replica_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``NOGRAD_*`` settings of ``environ`` every replica gets (its address is its own;
    one process each unless ``environ`` sets ``NOGRAD_WORKERS`` or ``NOGRAD_FRONTS``)."""
    given = {
        key: value
        for key, value in environ.items()
        if key.startswith(SETTINGS_PREFIX) and key not in OWN_SETTINGS
    }
    if given.keys() & ONE_PROCESS.keys():
        return given
    return {**given, **ONE_PROCESS}


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (held open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_replica(
    slot: int, http_port: int, grpc_port: int, settings: Mapping[str, str], folder: Path
) -> Replica:
    """A replica in slot ``slot``; its output goes to ``replica-<slot>.log`` in ``folder``."""
    log = folder / f"replica-{slot}.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(SETTINGS_PREFIX)},
        **settings,
        "NOGRAD_HOST": HOST,
        "NOGRAD_PORT": str(http_port),
        "NOGRAD_GRPC_PORT": str(grpc_port),
    }
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "nograd"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return Replica(slot, process.pid, http_port, grpc_port, str(log))


def is_ready(replica: Replica) -> bool:
    url = f"http://{HOST}:{replica.http_port}{READY_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(replica: Replica, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_ready(replica):
        if not alive(replica.pid):
            raise ReplicaError(f"replica{replica.slot} exited: {log_tail(replica)}")
        if time.monotonic() > deadline:
            raise ReplicaError(f"replica{replica.slot} not ready in {timeout_s:.0f}s")
        time.sleep(0.1)


def log_tail(replica: Replica, chars: int = 2000) -> str:
    try:
        return Path(replica.log).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop_process(pid: int, timeout_s: float) -> None:
    """SIGTERM ``pid`` (a server drains on it), wait up to ``timeout_s``, then SIGKILL its
    whole session (its workers with it)."""
    if not alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
