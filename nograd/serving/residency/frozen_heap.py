"""What the garbage collector walks: the libraries frozen out of it, and what a freed model left.

torch, transformers and the models leave millions of long-lived objects; every full collection
walked all of them and stopped every thread of the process while it did (the collector holds the
GIL), long enough to set the tail latency. Frozen (``gc.freeze``), they are never scanned again;
what requests allocate is still collected.

The heap is frozen after the start-up set has loaded, and after a later load only when something
imported a library since the last freeze (a module that is no model's code): the libraries stay
out of every walk, while a model loaded later stays unfrozen. Freeing a model needs a collection
(its module, classes and functions, modules and their hooks, an engine's session wrappers sit in
reference cycles that only the collector frees), and the collector never looks at frozen objects.
A model loaded since the last freeze is freed by a collection of the unfrozen heap alone, which
holds none of the libraries; a model frozen with the rest (loaded at start-up, or before a
library came) is freed only by unfreezing everything, collecting it all and freezing it again, a
full walk that pauses every model of the process. Without that, every unloaded version that was
frozen stayed resident for good.

The collector is one per process, and so is this module's account of it.
"""

from __future__ import annotations

import gc
import logging
import sys
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

MODEL_CODE = "nograd_models"
"""The package every model's code is imported under (``nograd.runtime.loader.module_name``):
a model's own modules come and go with it, and do not count as a library."""

_freezes = 0
"""How many times the heap was frozen: a version whose load began at a lower count was frozen."""
_frozen_modules: frozenset[str] = frozenset()
"""The library modules imported when the heap was last frozen."""


def freezes() -> int:
    """The count a version's load records as it begins (``frozen_since``)."""
    return _freezes


def frozen_since(mark: int | None) -> bool:
    """Whether the objects of a load that began at ``mark`` may be frozen (None: unknown)."""
    return mark is None or mark < _freezes


def settle_heap() -> None:
    """Collect, then move everything alive into the collector's permanent generation."""
    global _freezes, _frozen_modules
    gc.collect()
    gc.freeze()
    _freezes += 1
    _frozen_modules = library_modules()


def settle_new_libraries() -> None:
    """Freeze the heap again if something imported a library since it was last frozen (a later
    load's first model of a kind, a warm-up); a load that brought none leaves its model
    unfrozen, and what it left in cycles is collected from the unfrozen heap alone."""
    new = library_modules() - _frozen_modules
    if not new:
        gc.collect()  # what the load left in cycles, without a walk of the frozen heap
        return
    if _freezes:
        logger.info(
            "heap frozen again: %d library module(s) imported since, %s among them",
            len(new),
            min(new),
        )
    settle_heap()


def collect_freed(frozen: bool, alive: Callable[[], bool] = lambda: True) -> None:
    """Collect what a freed model left unreachable: the unfrozen heap first; when some of it
    was frozen and ``alive`` says the model's objects still live (a frozen cycle holds them),
    unfreeze everything, collect it all and freeze what is left again.

    A frozen model whose objects went with their last reference (an engine session, no cycle)
    needs no walk of the frozen heap: besides pausing every thread, that walk would freeze the
    models resident then, making each of their evictions walk it again in turn."""
    gc.collect()
    if frozen and alive():
        gc.unfreeze()
        settle_heap()


def library_modules() -> frozenset[str]:
    """The modules imported now that are no model's code."""
    return frozenset(
        name
        for name in list(sys.modules)
        if name != MODEL_CODE and not name.startswith(MODEL_CODE + ".")
    )


def still_alive(*objects: object) -> Callable[[], bool]:
    """Whether any of ``objects`` (a freed version's handler and code) still lives once its
    last reference is dropped: then a cycle holds it. An object that takes no weak reference
    counts as alive, so a frozen one is still collected by a walk of the whole heap."""
    refs: list[weakref.ref[object]] = []
    for each in objects:
        if each is None:
            continue
        try:
            refs.append(weakref.ref(each))
        except TypeError:
            return lambda: True
    return lambda: any(ref() is not None for ref in refs)
