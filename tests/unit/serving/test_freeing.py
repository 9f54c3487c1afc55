"""An unloaded or replaced version is freed: its handler, torch module and code become
unreachable and are collected, though the heap was frozen after they were loaded (the freeze
once kept every version that sat in a reference cycle for good)."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from nograd.serving.control.model_control import ModelControl
from nograd.serving.dataplane import DataPlane
from tests.unit.conftest import plane_for


class Loaded:
    """Weak references to what one load of ``heavy`` built: none of it may outlive the version."""

    def __init__(self, plane: DataPlane) -> None:
        handler = plane.models["heavy"].handler
        assert handler is not None
        # The model's code as imported: the module its torch module's class is defined in.
        code = sys.modules[type(handler.module).__module__]
        self.handler = weakref.ref(handler)
        self.module = weakref.ref(handler.module)
        self.code = weakref.ref(code)
        self.code_name = code.__name__

    def alive(self) -> list[str]:
        held = {
            "handler": self.handler() is not None,
            "torch module": self.module() is not None,
            "model code": self.code() is not None,
        }
        return [name for name, alive in held.items() if alive]


@pytest.fixture
async def heavy(tmp_path: Path) -> AsyncIterator[tuple[DataPlane, ModelControl]]:
    plane = plane_for(tmp_path, "heavy", model_control="explicit", load_models="heavy")
    control = ModelControl(plane)
    control.discover()
    await control.load_startup()
    yield plane, control
    await plane.stop(0)


async def answer(plane: DataPlane) -> float:
    _, outputs = await plane.infer("heavy", None, {"x": np.array([[1.0]], dtype=np.float32)})
    return float(outputs["y"][0][0])


async def test_an_unloaded_version_is_collected_and_its_code_forgotten(
    heavy: tuple[DataPlane, ModelControl],
) -> None:
    plane, control = heavy
    assert await answer(plane) == 2.0
    first = Loaded(plane)
    assert sys.modules[first.code_name] is first.code()
    assert gc.get_freeze_count() > 0, "the heap left after loading was not frozen"

    await control.unload("heavy")
    assert first.alive() == [], "still reachable after the unload"
    assert first.code_name not in sys.modules
    assert gc.get_freeze_count() > 0, "the heap was not frozen again after the collection"

    await control.load("heavy")
    second = Loaded(plane)
    assert await answer(plane) == 2.0
    assert sys.modules[second.code_name] is second.code()
    # Straight after a batch: the device thread still held the batch's work (and so the
    # handler) when a collection on the event loop ran, and the module's cycle was frozen again.
    await control.unload("heavy")
    assert second.alive() == []


async def test_a_replaced_version_is_collected_and_the_new_code_stays_imported(
    heavy: tuple[DataPlane, ModelControl],
) -> None:
    plane, control = heavy
    code_file = plane.models["heavy"].directory / "model.py"
    loads = [Loaded(plane)]
    for attempt in range(3):
        # A new modification time: the same version's files changed, so the load replaces it.
        os.utime(code_file, ns=(attempt + 1, attempt + 1))
        await control.load("heavy")
        loads.append(Loaded(plane))
        assert loads[-1].code() is not loads[-2].code(), "the version was not reloaded"
        assert loads[-2].alive() == [], f"reload {attempt + 1}: the replaced version lives on"
        # Same version, same module name: the new code is the one imported, not taken out.
        assert sys.modules[loads[-1].code_name] is loads[-1].code()
        assert await answer(plane) == 2.0
