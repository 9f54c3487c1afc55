"""A model loaded on demand with no memory profile remembered answers once it is loaded and
warmed up, planned on an estimate from its warm-up; its profile is measured at the first quiet
moment, and what it holds is counted on the measured cost from then on. Reloaded after an
eviction, it is planned on that profile at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.residency_models import MIB, write_onnx_model
from nograd.host.readings import resident_bytes
from nograd.observability.metrics import Metrics
from nograd.runtime.engines.onnx_mapped import map_weights
from nograd.runtime.memory.cost import Point
from nograd.runtime.memory.fits import Verdict
from nograd.runtime.runners import Handler
from nograd.runtime.warmup import warm_up
from nograd.serving import dataplane as dataplane_module
from nograd.serving.control import loading
from nograd.serving.control.model_control import ModelControl
from nograd.serving.control.repository import find_source, model_names
from nograd.serving.dataplane import DataPlane
from nograd.serving.residency import on_demand as on_demand_module
from nograd.serving.residency.on_demand import OnDemand
from nograd.settings import Settings


@pytest.fixture(autouse=True)
def weights_opened_as_they_are_after() -> Iterator[None]:
    """An on-demand control maps ONNX weights in this process until its server closes; these
    tests build one without a server: the next test opens ONNX files as they are again."""
    yield
    map_weights(None)


def verdicts(plane: DataPlane, name: str) -> set[Verdict]:
    plan = plane.models[name].plan
    assert plan is not None
    return {item.fit.verdict for item in plan.cost.ranges}


def limit_of(plane: DataPlane, name: str) -> int:
    batcher = plane.models[name].batcher
    assert batcher is not None
    return batcher.limit.current


async def until_measured(plane: DataPlane, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while plane.unmeasured(name):
        assert time.monotonic() < deadline, f"{name} was not profiled in {timeout_s}s"
        await asyncio.sleep(0.05)


async def asked_for(on_demand: OnDemand, name: str) -> None:
    """As a request for ``name`` does: held while it is loaded if it is not resident, then let
    go."""
    held = on_demand.hold(name)
    await on_demand.ensure(held)
    on_demand.release(held)


def counted_warm_ups(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[object]]:
    """The rounds each load's warm-up runs and the probe it measures with (None: measures
    nothing), in load order."""
    rounds: list[int] = []
    probes: list[object] = []

    def counted_warm_up(handler: Handler, limit: int, *args: Any, **kwargs: Any) -> list[Point]:
        rounds.append(args[0] if args else kwargs.get("rounds", 2))
        probes.append(args[1] if len(args) > 1 else kwargs.get("probe"))
        return warm_up(handler, limit, *args, **kwargs)

    monkeypatch.setattr(loading, "warm_up", counted_warm_up)
    return rounds, probes


async def one_model_on_demand(tmp_path: Path, write: bool = True) -> tuple[DataPlane, ModelControl]:
    """A plane under on-demand control over one small ONNX model, ``m3``, none loaded
    (``write=False``: the one an earlier plane wrote, as a restarted server finds it)."""
    if write:
        write_onnx_model(tmp_path / "repo" / "m3", 3, 2)
    settings = Settings(
        model_repository=tmp_path / "repo",
        model_control="on_demand",
        memory_limit_bytes=64 * MIB,
        engine_cache=tmp_path / "cache",
    )  # type: ignore[call-arg]
    plane = DataPlane(settings, Metrics())
    control = ModelControl(plane)
    await control.open()
    control.discover()
    await plane.load_all()  # the start-up set (none): later loads are on demand
    return plane, control


async def test_an_eviction_reads_the_files_to_keep_warm_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requests of the resident models wait for nothing an eviction reads from disk."""
    read_on: list[threading.Thread] = []

    def recorded_find_source(*args: Any) -> Any:
        read_on.append(threading.current_thread())
        return find_source(*args)

    plane, control = await one_model_on_demand(tmp_path)
    on_demand = OnDemand(control, plane, plane.metrics)
    monkeypatch.setattr(on_demand_module, "find_source", recorded_find_source)
    try:
        on_demand.opened()
        await asked_for(on_demand, "m3")
        read_on.clear()
        assert await on_demand._evict("m3", "memory")
        assert read_on and threading.main_thread() not in read_on
        assert "m3" in on_demand._warm
    finally:
        await control.close()
        await plane.stop(0)


async def test_an_eviction_advises_only_the_evicted_files_and_lists_no_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads follow each other under traffic: an eviction asks the kernel to keep the evicted
    model's files alone (the models evicted before were advised when they went), and a load of
    a model no ensemble runs lists no folder of the repository."""
    advised: list[set[str]] = []
    listed: list[Path] = []

    def recorded_keep_warm(paths: list[Path]) -> int:
        advised.append({m for m in ("m3", "m4") if any(f"/{m}/" in str(p) for p in paths)})
        return 0

    def recorded_model_names(root: Path) -> list[str]:
        listed.append(root)
        return model_names(root)

    write_onnx_model(tmp_path / "repo" / "m4", 4, 2)
    plane, control = await one_model_on_demand(tmp_path)
    on_demand = OnDemand(control, plane, plane.metrics)
    monkeypatch.setattr(on_demand_module, "keep_warm", recorded_keep_warm)
    monkeypatch.setattr(dataplane_module, "model_names", recorded_model_names)
    try:
        on_demand.opened()
        for name in ("m3", "m4"):
            await asked_for(on_demand, name)
        assert listed == []
        for name in ("m3", "m4"):
            assert await on_demand._evict(name, "memory")
        deadline = time.monotonic() + 10
        while len(advised) < 2:
            assert time.monotonic() < deadline, advised
            await asyncio.sleep(0.01)
        assert set(on_demand._warm) == {"m3", "m4"}
        assert advised == [{"m3"}, {"m4"}]
    finally:
        await control.close()
        await plane.stop(0)


async def test_a_cold_model_answers_on_an_estimate_then_counts_its_measured_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds, _ = counted_warm_ups(monkeypatch)
    plane, control = await one_model_on_demand(tmp_path)
    on_demand = OnDemand(control, plane, plane.metrics)
    try:
        on_demand.opened()
        await asked_for(on_demand, "m3")
        model = plane.models["m3"]
        assert model.ready and model.plan is not None
        # Answered before any profile ran: planned on the estimate, counted on it.
        assert plane.unmeasured("m3")
        assert verdicts(plane, "m3") == {Verdict.ESTIMATED}
        assert "profile" not in model.phases
        counted = on_demand.residency.resident["m3"].bytes
        outside = counted - model.plan.minimum_bytes
        assert outside >= model.weights_bytes

        await until_measured(plane, "m3")
        assert Verdict.ESTIMATED not in verdicts(plane, "m3")
        assert model.phases["profile"] > 0
        # Counted on the measured smallest batch now (and what reopening its sessions added).
        assert on_demand.residency.resident["m3"].bytes >= outside + model.plan.minimum_bytes
        assert on_demand.residency.measured["m3"] == on_demand.residency.resident["m3"].bytes
        assert list((tmp_path / "cache").rglob("m3-v1-profile-*.json"))

        # Unloaded and asked for again: planned on the measured profile at once, and warmed up
        # by one round, measuring nothing (the first load's two rounds measured its estimate).
        await control.apply({"op": "unload", "name": "m3"})
        await asked_for(on_demand, "m3")
        assert not plane.unmeasured("m3")
        assert Verdict.ESTIMATED not in verdicts(plane, "m3")
        assert rounds == [2, 1]
    finally:
        await control.close()
        await plane.stop(0)


async def test_a_model_loaded_at_start_up_warms_up_by_one_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its memory profile is measured apart from its warm-up: one round pays every shape's lazy
    set-up, and a second would only repeat it."""
    rounds, probes = counted_warm_ups(monkeypatch)
    write_onnx_model(tmp_path / "repo" / "m3", 3, 2)
    settings = Settings(model_repository=tmp_path / "repo", engine_cache=tmp_path / "cache")  # type: ignore[call-arg]
    plane = DataPlane(settings, Metrics())
    control = ModelControl(plane)
    await control.open()
    try:
        control.discover()
        await plane.load_all()
        assert plane.models["m3"].ready
        assert rounds == [1] and probes == [None]
    finally:
        await control.close()
        await plane.stop(0)


async def test_a_restart_warms_a_model_with_a_remembered_profile_by_one_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load after a restart is planned on the profile the engine cache remembers, as a
    reload is: its warm-up measures nothing and runs one round, so a cold request waits for no
    more than a reload does."""
    rounds, probes = counted_warm_ups(monkeypatch)
    for write in (True, False):  # a first process, then a restart over the same cache
        plane, control = await one_model_on_demand(tmp_path, write)
        on_demand = OnDemand(control, plane, plane.metrics)
        try:
            on_demand.opened()
            await asked_for(on_demand, "m3")
            if write:
                await until_measured(plane, "m3")
            assert not plane.unmeasured("m3") or write
        finally:
            await control.close()
            await plane.stop(0)
    assert rounds == [2, 1]
    assert probes[0] is not None and probes[1] is None
    assert "profile" not in plane.models["m3"].phases


async def test_a_model_evicted_before_its_profile_reloads_on_its_first_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under steady traffic no quiet moment profiles a model, and it may be evicted and loaded
    again many times on its estimate: each reload plans on the estimate its first warm-up gave
    and warms up by one round, measuring nothing, and the model still waits to be profiled."""
    rounds, probes = counted_warm_ups(monkeypatch)
    plane, control = await one_model_on_demand(tmp_path)
    on_demand = OnDemand(control, plane, plane.metrics)
    # Never quiet: the profile waits for good.
    monkeypatch.setattr(on_demand._profiles, "_busy", lambda: True)
    try:
        on_demand.opened()
        await asked_for(on_demand, "m3")
        first = plane.models["m3"].plan
        assert first is not None and plane.unmeasured("m3")
        assert await on_demand._evict("m3", "memory")
        await asked_for(on_demand, "m3")
        again = plane.models["m3"].plan
        assert again is not None and again.cost == first.cost
        assert verdicts(plane, "m3") == {Verdict.ESTIMATED}
        assert plane.unmeasured("m3")
        assert rounds == [2, 1]
        assert probes[0] is not None and probes[1] is None
    finally:
        await control.close()
        await plane.stop(0)


@pytest.mark.parametrize("both", [False, True], ids=["the-room-left", "every-model-resident"])
async def test_a_load_that_holds_more_than_expected_leaves_the_batch_limits_while_room_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, both: bool
) -> None:
    """A model whose load added more to the process than its files waits for the room it really
    takes (here the grace of the models resident): meanwhile the models already serving keep the
    batch limits planned when there was room, and are planned again once the room is made; a
    plan over the limit would leave them no batch at all (every request refused). ``both``: the
    load adds exactly the room left and nearly all the residents hold, so that both must go; the
    plan made when the first is evicted must not count it yet (it would leave the second none)."""
    for index in (4, 5):
        write_onnx_model(tmp_path / "repo" / f"m{index}", index, 2)
    plane, control = await one_model_on_demand(tmp_path)
    on_demand = OnDemand(control, plane, plane.metrics)
    real = resident_bytes
    inflating = {"by": 0, "calls": 0, "from": 0}

    def inflated(pid: int) -> int | None:
        """The process's resident memory; from the first reading of m5's load on, exactly that
        reading plus ``inflating["by"]``: whatever else the test's process allocates meanwhile
        (another test's threads share it) must not move what m5 seems to hold."""
        reading = real(pid)
        if not inflating["by"] or reading is None:
            return reading
        inflating["calls"] += 1
        if inflating["calls"] == 1:
            inflating["from"] = reading
            return reading
        return inflating["from"] + inflating["by"]

    monkeypatch.setattr(on_demand_module, "resident_bytes", inflated)
    try:
        on_demand.opened()
        for name in ("m3", "m4"):
            await asked_for(on_demand, name)
        limits = {name: limit_of(plane, name) for name in ("m3", "m4")}
        assert min(limits.values()) >= 1, limits
        room = on_demand.residency.limit - on_demand.residency.used
        resident = [on_demand.residency.resident[name].bytes for name in ("m3", "m4")]
        # Its load seems to take all the room left, and half a resident's bytes more (one
        # eviction makes the room); with ``both``, what both residents hold, less m5's smallest
        # batch and a margin (both must go).
        inflating["by"] = room + (sum(resident) - 2 * MIB if both else min(resident) // 2)
        seen: list[dict[str, int]] = []
        replan = plane.replan

        def replanned() -> None:
            """Each plan made meanwhile (an eviction's among them), read as it is made."""
            replan()
            seen.append({n: limit_of(plane, n) for n in plane.models if n != "m5"})

        monkeypatch.setattr(plane, "replan", replanned)
        load = asyncio.create_task(asked_for(on_demand, "m5"))
        while not load.done():
            seen.append({n: limit_of(plane, n) for n in plane.models if n != "m5"})
            await asyncio.sleep(0.01)
        await load
        assert on_demand.residency.resident["m5"].bytes > room  # it waited for room
        assert seen and all(min(each.values()) >= 1 for each in seen if each), seen
        evicted = {"m3", "m4"} - set(on_demand.residency.resident)
        assert evicted == {"m3", "m4"} if both else evicted, evicted
        assert limit_of(plane, "m5") >= 1
    finally:
        await control.close()
        await plane.stop(0)
