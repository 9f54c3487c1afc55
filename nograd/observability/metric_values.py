"""prometheus_client's file-backed values, with this process's id read from memory.

Its values shared through files (several processes, ``PROMETHEUS_MULTIPROC_DIR``) ask the kernel
for the process id on every update, to notice a fork: a fifth to a third of an update's cost on
the request path. nograd's processes are spawned; a fork still renews the id here.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import values

_PROCESS_ID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PROCESS_ID.__setitem__(0, os.getpid()))


def _process_id() -> int:
    return _PROCESS_ID[0]


def remember_process_id() -> None:
    """File-backed values from now on read the process id from memory. Only while this process
    has written no value yet, so that no file ever has two writers."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory or values.ValueClass is values.MutexValue:
        return
    if any(Path(directory).glob(f"*_{os.getpid()}.db")):
        return
    values.ValueClass = values.MultiProcessValue(process_identifier=_process_id)  # type: ignore[no-untyped-call]
