"""How long torch's OpenMP threads spin for the next parallel region before they sleep.

GNU OpenMP (the runtime torch's Linux wheels ship) reads ``GOMP_SPINCOUNT`` once, when torch is
first imported, so this runs before that import. Between two batches the second core's OpenMP
thread used to fall asleep, and waking it (on a virtual machine, waking its idle vCPU) cost more
than small batches took: one process serving digits at 32 concurrent requests on 2 cores left
0.35-0.45 cores idle. Spinning up to a million iterations (about 25 ms here) kept them busy:
2,027-2,791 against 1,785-2,293 requests/s, p99 23-30 against 35-48 ms (four alternated runs);
minilm (forwards of tens of milliseconds, back to back under load) served the same either way.
An idle server stops spinning within those milliseconds. Under a CPU quota (a Kubernetes limit)
the spin is charged to the quota, and still paid: in a 1.8-CPU CFS quota with 2 threads, digits
served 2,122-2,702 against 1,783-2,011 requests/s (p99 24-28 against 36-38 ms), throttled in
nearly every period either way; minilm 162 / 167 against 153 / 160 sentences/s.

Only for a single process: with several workers sharing the cores batch by batch
(nograd/host/ledger.py), a thread still spinning after its batch holds a core the ledger has
handed to another worker. Two workers with the spin (alternated, c=32): digits gained (3,245 /
4,021 / 3,941 against 3,323 / 3,592 / 3,062 requests/s) but minilm lost its tail (minilm-1 p99
228 / 159 / 210 against 156 / 164 / 154 ms; minilm-8 32.9 / 30.6 against 38.6 / 31.9 requests/s).
A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` the operator set wins.

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
