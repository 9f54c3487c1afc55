"""How long torch's OpenMP threads spin for the next parallel region before they sleep.

GNU OpenMP (the runtime torch's Linux wheels ship) reads ``GOMP_SPINCOUNT`` once, when torch is
first imported, so this runs before that import. Between two batches the second core's OpenMP
thread used to fall asleep, and waking it (on a virtual machine, waking its idle vCPU) cost more
than small batches took; spinning for the next batch keeps it awake, and an idle server stops
spinning within milliseconds. It pays under a CPU quota too, where the spin is charged to it.

Only for a single process: with several workers sharing the cores batch by batch
(``nograd.host.ledger``), a thread still spinning after its batch holds a core the ledger has
handed to another worker. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` the operator set wins. The
measurements are in docs/architecture.md.

This module imports no torch.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Final

SPIN_COUNT: Final = "1000000"


def tune_openmp_wait(environ: MutableMapping[str, str], workers: int) -> bool:
    """Set the spin count for a single-process server; True when it was set."""
    if workers > 1 or "torch" in sys.modules:
        return False  # shared cores (see above), or too late: the runtime has read it
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
