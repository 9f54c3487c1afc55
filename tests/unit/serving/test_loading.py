"""After loading, the heap is frozen so full collections stop walking the models' objects; after
freeing a model, what it left is collected, frozen or not."""

from __future__ import annotations

import gc
import weakref

from nograd.serving.loading import collect_frozen, settle_heap


def test_settled_heap_is_frozen_and_new_garbage_still_collected() -> None:
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0

        class Cycle:
            other: object = None

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2, "a cycle created after the freeze was not collected"
    finally:
        gc.unfreeze()


def test_collect_frozen_frees_a_cycle_that_was_frozen() -> None:
    class Node:
        other: object = None

    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        settle_heap()
        del a, b
        gc.collect()
        assert ref() is not None, "a frozen cycle is never collected: what kept unloaded models"
        collect_frozen()
        assert ref() is None
        assert gc.get_freeze_count() > 0, "the heap was not frozen again"
    finally:
        gc.unfreeze()
