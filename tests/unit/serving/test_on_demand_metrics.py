"""The placement series on-demand control publishes: the limit and free room from the start,
and a model's requests in flight only for models of the repository, whatever names clients
send."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from nograd.serving.control.model_control import ModelControl
from nograd.serving.residency.on_demand import OnDemand
from tests.unit.conftest import plane_for

MIB = 1 << 20


def samples(registry: CollectorRegistry, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name
    ]


async def test_requests_in_flight_are_published_for_models_of_the_repository_only(
    tmp_path: Path,
) -> None:
    plane = plane_for(tmp_path, "poison", model_control="on_demand", memory_limit_bytes=64 * MIB)
    control = ModelControl(plane)
    await control.open()
    control.discover()
    on_demand = OnDemand(control, plane, plane.metrics)
    try:
        on_demand.opened()
        registry = plane.metrics.registry
        assert samples(registry, "nograd_memory_limit_bytes") == [({}, 64 * MIB)]
        assert samples(registry, "nograd_memory_free_bytes") == [({}, 64 * MIB)]

        for name in ("nowhere", "random-1", "random-2"):
            held = on_demand.hold(name)
            await on_demand.ensure(held)  # a name the repository lacks: left to the 404
            on_demand.release(held)
        assert samples(registry, "nograd_model_inflight_requests") == []
        assert samples(registry, "nograd_model_loading") == []

        held = on_demand.hold("poison")
        await on_demand.ensure(held)
        assert samples(registry, "nograd_model_inflight_requests") == [({"model": "poison"}, 1)]
        assert samples(registry, "nograd_model_loading") == [({"model": "poison"}, 0)]
        on_demand.release(held)
        assert samples(registry, "nograd_model_inflight_requests") == [({"model": "poison"}, 0)]
        used = on_demand.residency.used
        assert used > 0
        assert samples(registry, "nograd_memory_free_bytes") == [({}, 64 * MIB - used)]
    finally:
        on_demand.closed()
        await control.close()
        await plane.stop(0)
