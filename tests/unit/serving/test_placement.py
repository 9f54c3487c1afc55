"""The placement view: each model resident, loading or not with the bytes it holds and the
requests holding it, and the limit, used and free bytes a balancer reads."""

from __future__ import annotations

from pathlib import Path

from nograd.schema.config import ModelConfig
from nograd.serving.control.peers import Peers
from nograd.serving.registry import ModelRegistry, ServedModel, State
from nograd.serving.residency.placement import (
    LOADING,
    NOT_RESIDENT,
    RESIDENT,
    ModelPlacement,
    combined,
    model_placements,
    placement_document,
)
from nograd.serving.residency.policy import Residency

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
        "resident_workers": 1,
    }
    over = placement_document(rows, 8 * MIB, "on_demand", 2)
    assert over["memory"]["free_bytes"] == 0  # a first load measured more than it was given
    unlimited = placement_document(rows, None, "none", 1)
    assert unlimited["memory"] == {"limit_bytes": None, "used_bytes": 16 * MIB, "free_bytes": None}


def test_the_workers_views_add_up_to_the_servers() -> None:
    first = placement_document(
        [
            ModelPlacement("a", RESIDENT, 10 * MIB, 1, 2, False),
            ModelPlacement("b", NOT_RESIDENT, 0, 0, 0, False),
        ],
        32 * MIB,
        "on_demand",
        2,
    )
    second = placement_document(
        [
            ModelPlacement("a", RESIDENT, 11 * MIB, 0, 1, False),
            ModelPlacement("b", LOADING, 0, 0, 4, False),
        ],
        32 * MIB,
        "on_demand",
        2,
    )
    server = combined([first, second])
    assert (server["workers"], server["workers_answered"]) == (2, 2)
    assert server["memory"] == {
        "limit_bytes": 64 * MIB,
        "used_bytes": 21 * MIB,
        "free_bytes": 43 * MIB,
    }
    a, b = server["models"]
    assert (a["state"], a["bytes"], a["queue_depth"], a["in_flight"], a["resident_workers"]) == (
        RESIDENT,
        21 * MIB,
        1,
        3,
        2,
    )
    assert (b["state"], b["in_flight"], b["resident_workers"]) == (LOADING, 4, 0)
    assert combined([first]) is first
    assert first["models"][0]["bytes"] == 10 * MIB  # the workers' own views are left as they were


async def test_a_worker_gathers_its_siblings_answers(tmp_path: Path) -> None:
    async def apply(call: dict[str, object]) -> str | None:
        return None

    workers = [Peers(tmp_path, apply) for _ in range(3)]
    for number, peers in enumerate(workers):
        peers._path = peers.directory / f"{number}.sock"  # three workers in one test process
        peers.answers["placement"] = lambda call, number=number: {"worker": number, **call}
        await peers.start()
    try:
        answers = await workers[0].gather({"op": "placement"}, timeout_s=5)
        assert sorted(a["worker"] for a in answers) == [1, 2]
        assert all(a["op"] == "placement" for a in answers)
        await workers[2].stop()  # a worker that stopped is left out
        assert [a["worker"] for a in await workers[0].gather({"op": "placement"}, 5)] == [1]
        assert await workers[1].broadcast({"op": "load"}) == {}  # control calls as before
    finally:
        for peers in workers:
            await peers.stop()
