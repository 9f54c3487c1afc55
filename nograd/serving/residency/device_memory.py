"""The memory of each device the served models run on, as the metrics report it."""

from __future__ import annotations

from collections.abc import Iterator

from nograd.runtime.devices import device_label, read_memory, resolve_device
from nograd.serving.registry import ModelRegistry


def memory_readings(registry: ModelRegistry) -> Iterator[tuple[str, int, int, int, int]]:
    """(device, allocated, reserved, peak, total) for each device a served model runs on; the
    CPU when none does."""
    devices = {
        device_label(m.handler.device): m.handler.device
        for m in registry.served()
        if m.handler is not None
    }
    if not devices:
        devices = {"cpu": resolve_device("cpu")}
    for label, device in devices.items():
        reading = read_memory(device)
        yield label, reading.allocated, reading.reserved, reading.peak, reading.total
