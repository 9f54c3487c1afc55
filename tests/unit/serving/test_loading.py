"""The heap is frozen so full collections stop walking the libraries' objects; a model loaded
since the last freeze is freed without unfreezing anything, and what a frozen one left is
collected all the same."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections.abc import Iterator

import pytest

from nograd.serving.residency.frozen_heap import (
    MODEL_CODE,
    collect_freed,
    freezes,
    frozen_since,
    settle_heap,
    settle_new_libraries,
    still_alive,
)


class Node:
    other: object = None


@pytest.fixture(autouse=True)
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settled_heap_is_frozen_and_new_garbage_still_collected() -> None:
    settle_heap()
    assert gc.get_freeze_count() > 0
    ref = cycle()
    assert gc.collect() >= 2, "a cycle created after the freeze was not collected"
    assert ref() is None


def test_a_frozen_cycle_is_freed_only_by_unfreezing() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    settle_heap()
    del a, b
    mark_before = freezes() - 1
    assert frozen_since(mark_before) and frozen_since(None)
    collect_freed(frozen=False)
    assert ref() is not None, "a frozen cycle is never collected: what kept unloaded models"
    collect_freed(frozen=True)
    assert ref() is None
    assert gc.get_freeze_count() > 0, "the heap was not frozen again"


def test_a_cycle_made_after_the_freeze_is_freed_without_unfreezing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Whether the heap was unfrozen is watched, not read off the frozen count: a frozen object
    # that loses its last reference (another test's thread ending) lowers the count too.
    unfreeze, walks = gc.unfreeze, []

    def counted() -> None:
        walks.append(1)
        unfreeze()

    monkeypatch.setattr(gc, "unfreeze", counted)
    settle_heap()
    mark = freezes()
    ref = cycle()
    assert not frozen_since(mark)
    collect_freed(frozen_since(mark))
    assert ref() is None
    assert not walks, "the frozen heap was walked again"


def test_only_a_new_library_freezes_the_heap_again() -> None:
    settle_heap()
    mark = freezes()
    model_code = f"{MODEL_CODE}.model.v1"
    sys.modules[model_code] = types.ModuleType(model_code)
    library = "nograd_test_library_imported_by_a_load"
    try:
        settle_new_libraries()
        assert freezes() == mark, "a model's own code froze the heap"
        sys.modules[library] = types.ModuleType(library)
        settle_new_libraries()
        assert freezes() == mark + 1 and frozen_since(mark)
    finally:
        del sys.modules[model_code]
        sys.modules.pop(library, None)


def test_a_frozen_model_freed_by_its_last_reference_leaves_the_heap_frozen() -> None:
    """A frozen model whose objects went with their last reference (no cycle holds them) is
    not a reason to walk the frozen heap: that walk would freeze the models resident then,
    and each of their evictions would walk it again in turn."""
    kept = Node()
    alive = weakref.ref(kept)
    settle_heap()
    mark = freezes() - 1
    del kept
    collect_freed(frozen_since(mark), lambda: alive() is not None)
    assert freezes() == mark + 1, "the frozen heap was walked for a model already freed"


def test_a_frozen_model_a_cycle_still_holds_is_collected_by_a_walk() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    settle_heap()
    mark = freezes() - 1
    del a, b
    collect_freed(frozen_since(mark), lambda: ref() is not None)
    assert ref() is None
    assert freezes() == mark + 2 and gc.get_freeze_count() > 0


def test_still_alive_tells_a_freed_object_from_one_a_cycle_holds() -> None:
    a, b, freed = Node(), Node(), Node()
    a.other, b.other = b, a
    held = still_alive(a, None)
    gone = still_alive(freed)
    del a, b, freed
    assert held() and not gone()
    gc.collect()
    assert not held()
    assert still_alive(1)(), "an object without weak references counts as alive"
