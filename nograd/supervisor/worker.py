"""A worker process's entry: what it is given by the supervisor, and how it starts serving.

The supervisor imports nothing that serves: the command names the serving function
(``"module:function"``, as uvicorn names an app), and only the spawned worker imports it, so the
supervisor process never loads torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Protocol

from nograd.host.collector import collect_young_less_often
from nograd.host.ledger import CoreShare
from nograd.observability.logs import setup_logging
from nograd.settings import Settings
from nograd.supervisor.handoff import Handoff
from nograd.supervisor.stopping import DRAIN_SIGNAL, STOP_SIGNALS

STARTUP_FAILURE = 3
"""Exit code of a worker whose start-up failed (uvicorn's own code for it)."""


@dataclass(frozen=True)
class WorkerContext:
    """What a worker process is given by its supervisor: the folder it shares with its
    siblings, how to say it is warm, and its slot in the shared core ledger."""

    shared_dir: Path
    ready: Callable[[], None]
    """Tells the supervisor the models are loaded and warm."""
    cores: CoreShare | None = None
    """This worker's slot in the ledger of CPU cores the workers share (``share_cores``)."""
    index: int = 0
    """Its slot among the supervisor's workers (0: the first started)."""
    engine_socket: Path | None = None
    """With an engine process and fronts (``fronts``): where the engine listens for them."""


class ServeWorker(Protocol):
    """Serves until stopped, with connections from ``handoff``; False if start-up failed."""

    def __call__(self, settings: Settings, context: WorkerContext, handoff: Handoff) -> bool: ...


def load_serve(reference: str) -> ServeWorker:
    """The serving function named ``"module:function"``."""
    module_name, _, name = reference.partition(":")
    serve: ServeWorker = getattr(importlib.import_module(module_name), name)
    return serve


def worker_main(
    serve: str,
    settings: Settings,
    shared_dir: Path,
    *,
    ready: Event,
    handoff: Handoff,
    supervisor: int,
    cores: CoreShare | None,
    index: int = 0,
    engine_socket: Path | None = None,
    after: Event | None = None,
) -> None:
    # A signal to the whole process group (Ctrl+C, ``kill -- -PGID``, systemd) reaches every
    # worker too: workers ignore it and drain on the supervisor's word (``DRAIN_SIGNAL``), so one
    # stop is never read as two. Set before any import, so loading is not cut either.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _exit_with_supervisor(supervisor)
    setup_logging(
        settings.log_level,
        settings.log_format,
        keys=settings.api_key_list + settings.operator_key_list,
    )
    collect_young_less_often()  # a spawned process starts with the interpreter's thresholds
    serve_worker = load_serve(serve)
    if after is not None:
        # Imported beside the workers before it, a worker loads its models only once the one
        # before is warm (``after``): loads never share the cores, and each later worker reads
        # the engine choices and memory profiles the first one measured from the engine cache.
        after.wait()
    started = serve_worker(
        settings, WorkerContext(shared_dir, ready.set, cores, index, engine_socket), handoff
    )
    sys.exit(0 if started else STARTUP_FAILURE)


def _exit_with_supervisor(supervisor: int) -> None:
    """Ask Linux for the drain signal when the supervisor dies, so a killed supervisor leaves no
    worker serving unsupervised: the worker finishes what it accepted and exits."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, DRAIN_SIGNAL)
    if os.getppid() != supervisor:  # it died before prctl took effect
        os.kill(os.getpid(), DRAIN_SIGNAL)
