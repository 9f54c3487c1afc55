"""After loading, the heap is frozen so full collections stop walking the models' objects."""

from __future__ import annotations

import gc

from nograd.serving.loading import settle_heap


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
