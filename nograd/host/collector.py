"""How often the garbage collector walks a serving process's young objects.

CPython collects its youngest generation every 700 net allocations of container objects. A
process with many calls under way keeps each call's objects (its frames, closures, futures,
decoded request and answer) alive until the call is answered, so each such collection walks the
same live objects of every waiting call again, and promotes them, only to find them garbage
later in an older generation. The engine process holds every front's calls at once and paid for
it on every call. Collecting the youngest generation once per ``YOUNG_OBJECTS`` allocations walks
those objects far less often; the cycles requests leave (an exception and its frames) are freed
a little later, a bounded amount. The libraries stay out of every walk (``gc.freeze``,
``nograd.serving.residency.frozen_heap``).

This module imports no torch.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_OBJECTS: Final = 20_000
"""Net allocations of container objects between two collections of the youngest generation."""


def collect_young_less_often() -> None:
    """Collect the youngest generation once per ``YOUNG_OBJECTS`` allocations (never more often
    than the interpreter already does); the older generations keep their thresholds."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_OBJECTS), middle, old)
