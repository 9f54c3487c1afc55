"""The folder the worker processes share: metric files, V2 statistics files, the core ledger.

prometheus_client's multiprocess mode keeps every worker's metrics in files of one folder, so
/metrics on any worker reports the whole server; the statistics and the core ledger sit beside them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nograd.observability.metrics_port import serve_metrics_port
from nograd.observability.stats import STATS_PREFIX

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTROL_FOLDER = "control"
"""The workers' model control sockets, lock and state (``nograd.serving.control.peers``)."""
UPLOADS_FOLDER = "uploads"
"""The models uploaded with load calls (``nograd.serving.control.uploads``)."""
CORES_FILE = "cores.i64"
"""The shared ledger of CPU cores (``nograd.host.ledger``), in the shared folder."""
ENGINE_SOCKET = "engine.sock"
"""Where the engine process listens for its fronts (``nograd.bridge``), in the shared folder."""
_SOCKET_PATH_MAX = 100
"""A Unix socket's path must fit in ``sun_path`` (108 bytes on Linux)."""


def prepare_shared_dir() -> tuple[Path, bool]:
    """The folder for the workers' shared files, emptied: an operator's, or a private one (then
    True: the supervisor removes it when it stops).

    Files left by an earlier run would add its counts to this one's.
    """
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        directory = Path(given)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in (*directory.glob("*.db"), *directory.glob(f"{STATS_PREFIX}*")):
            stale.unlink()
        # An earlier run's model control state would load its models into this one; its
        # uploads, with that state gone, would only take disk.
        shutil.rmtree(directory / CONTROL_FOLDER, ignore_errors=True)
        shutil.rmtree(directory / UPLOADS_FOLDER, ignore_errors=True)
        return directory, False
    directory = Path(tempfile.mkdtemp(prefix="nograd-metrics-"))
    # Set before any prometheus_client import here or in a worker: it picks file-backed values
    # once, at import.
    os.environ[MULTIPROC_ENV] = str(directory)
    return directory, True


def engine_socket_path(directory: Path) -> Path:
    """The engine's socket: in the shared folder, or in a private folder of its own when the
    shared folder's path is too long for a Unix socket."""
    path = directory / ENGINE_SOCKET
    if len(os.fsencode(path)) <= _SOCKET_PATH_MAX:
        return path
    return Path(tempfile.mkdtemp(prefix="nograd-engine-")) / ENGINE_SOCKET


def mark_dead(pid: int, directory: Path) -> None:
    """Drop a dead worker's live gauges; its counters stay, so totals never go backwards."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


def serve_metrics(directory: Path, host: str, port: int, keys: Sequence[str] = ()) -> None:
    """Serve every worker's metrics, read from the shared folder's files, on ``port`` (with
    ``keys``, only to scrapes that carry one)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    serve_metrics_port(host, port, registry, keys)
