"""A serving function for the supervisor's start-up test: no server, only marks in a folder
(``MARKS_ENV``, set by the test) of when each worker process imported it, began loading and
became warm."""

from __future__ import annotations

import os
import time
from pathlib import Path

from nograd.settings import Settings
from nograd.supervisor.handoff import Handoff
from nograd.supervisor.worker import WorkerContext

MARKS_ENV = "START_ORDER_MARKS"
LOAD_WAIT_S = 60.0
"""How long the first worker's load waits for every worker to have imported this module."""


def mark(name: str, at: float) -> None:
    folder = Path(os.environ[MARKS_ENV])
    (folder / f"{name}.tmp").write_text(repr(at))
    os.replace(folder / f"{name}.tmp", folder / name)


if MARKS_ENV in os.environ:  # imported by a worker process, before it may load
    mark(f"imported-{os.getpid()}", time.monotonic())


def serve(settings: Settings, context: WorkerContext, handoff: Handoff) -> bool:
    """Marks its load; with index 0, holds it until every worker has imported this module,
    which only a start of every worker at once allows. Then warm until stopped."""
    del handoff
    mark(f"loading-{context.index}", time.monotonic())
    if context.index == 0:
        folder = Path(os.environ[MARKS_ENV])
        deadline = time.monotonic() + LOAD_WAIT_S
        while len(list(folder.glob("imported-*[0-9]"))) < settings.worker_count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    mark(f"ready-{context.index}", time.monotonic())
    context.ready()
    time.sleep(LOAD_WAIT_S)  # until the supervisor's drain signal
    return True
