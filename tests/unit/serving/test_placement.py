"""The placement view: each model resident, loading or not with the bytes it holds and the
requests holding it, and the limit, used and free bytes a balancer reads."""

from __future__ import annotations

from pathlib import Path

from nograd.schema.config import ModelConfig
from nograd.serving.placement import (
    LOADING,
    NOT_RESIDENT,
    RESIDENT,
    ModelPlacement,
    model_placements,
    placement_document,
)
from nograd.serving.registry import ModelRegistry, ServedModel, State
from nograd.serving.residency import Residency

MIB = 1 << 20


def served(registry: ModelRegistry, name: str, state: State, tmp_path: Path) -> ServedModel:
    config = ModelConfig.model_validate(
        {
            "name": name,
            "weights": "",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        }
    )
    model = ServedModel(config, tmp_path, state=state, weights_bytes=3 * MIB)
    registry.add(model)
    return model


def test_on_demand_rows_say_what_is_resident_loading_and_held(tmp_path: Path) -> None:
    registry = ModelRegistry()
    served(registry, "warm", State.READY, tmp_path)
    residency = Residency(64 * MIB)
    residency.admit("warm", 10 * MIB, pinned=False, load_seconds=0.5)
    residency.admit("fixed", 4 * MIB, pinned=True, load_seconds=0.0)
    residency.hold("warm")
    residency.hold("warm")
    residency.hold("cold")  # a request waiting for its load holds it
    rows = model_placements(
        ["warm", "fixed", "cold", "idle"], registry, residency, loading=["cold"], pinned=["fixed"]
    )
    assert rows == [
        ModelPlacement("cold", LOADING, 0, 0, 1, False),
        ModelPlacement("fixed", RESIDENT, 4 * MIB, 0, 0, True),
        ModelPlacement("idle", NOT_RESIDENT, 0, 0, 0, False),
        ModelPlacement("warm", RESIDENT, 10 * MIB, 0, 2, False),
    ]
    residency.evicted("warm")
    (warm,) = [r for r in model_placements(["warm"], registry, residency) if r.name == "warm"]
    assert (warm.state, warm.bytes) == (NOT_RESIDENT, 0)


def test_without_on_demand_a_loading_version_is_loading_and_a_served_one_counts(
    tmp_path: Path,
) -> None:
    registry = ModelRegistry()
    served(registry, "starting", State.LOADING, tmp_path)
    failed = served(registry, "broken", State.FAILED, tmp_path)
    failed.hold()
    rows = {row.name: row for row in model_placements(["starting", "broken"], registry, None)}
    assert rows["starting"].state == LOADING
    assert (rows["broken"].state, rows["broken"].bytes, rows["broken"].in_flight) == (
        NOT_RESIDENT,
        0,
        1,
    )


def test_the_document_adds_up_the_resident_bytes_against_the_limit() -> None:
    rows = [
        ModelPlacement("a", RESIDENT, 10 * MIB, 2, 3, False),
        ModelPlacement("b", RESIDENT, 6 * MIB, 0, 0, True),
        ModelPlacement("c", LOADING, 0, 0, 1, False),
    ]
    document = placement_document(rows, 64 * MIB, "on_demand", 1)
    assert document["memory"] == {
        "limit_bytes": 64 * MIB,
        "used_bytes": 16 * MIB,
        "free_bytes": 48 * MIB,
    }
    assert document["models"][0] == {
        "name": "a",
        "state": RESIDENT,
        "bytes": 10 * MIB,
        "queue_depth": 2,
        "in_flight": 3,
        "pinned": False,
    }
    over = placement_document(rows, 8 * MIB, "on_demand", 2)
    assert over["memory"]["free_bytes"] == 0  # a first load measured more than it was given
    unlimited = placement_document(rows, None, "none", 1)
    assert unlimited["memory"] == {"limit_bytes": None, "used_bytes": 16 * MIB, "free_bytes": None}
