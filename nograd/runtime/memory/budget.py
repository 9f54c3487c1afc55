"""Budgets: the device memory given to batches, its share per model, and each model's batch
limit; the plan table logged at start-up."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nograd.runtime.memory.cost import CostModel
from nograd.runtime.memory.probes import MemoryProbe


def device_budget(probe: MemoryProbe, fraction: float, explicit_bytes: int | None) -> int:
    """Bytes the batcher may spend on activations on one device.

    Call it after every model on the device is loaded: availability then already excludes
    the weights, and the fraction leaves headroom for fragmentation, allocator slack and
    whatever the cost model misses.  An operator-supplied byte count always wins.
    """
    if explicit_bytes is not None:
        if explicit_bytes < 0:
            raise ValueError(f"explicit budget must be >= 0, got {explicit_bytes}")
        return explicit_bytes
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(fraction * probe.available_bytes())


def share_budget(budget: int, models: Mapping[str, float]) -> dict[str, int]:
    """Splits a device budget among its models in proportion to their weights.

    Weights are typically per-row cost times max batch size, so a small model is not handed
    gigabytes it can never use while a large one starves.  Remainders go to the largest
    fractional shares so the split adds up to the budget exactly and never exceeds it.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if any(not math.isfinite(w) or w < 0 for w in models.values()):
        raise ValueError("model weights must be finite and >= 0")
    if not models:
        return {}
    total = sum(models.values())
    weights = dict(models) if total > 0 else dict.fromkeys(models, 1.0)
    total = sum(weights.values())
    exact = {name: budget * w / total for name, w in weights.items()}
    shares = {name: math.floor(value) for name, value in exact.items()}
    leftover = budget - sum(shares.values())
    by_remainder = sorted(exact, key=lambda name: (shares[name] - exact[name], name))
    for name in by_remainder[: max(0, leftover)]:
        shares[name] += 1
    return shares


def batch_limit(model: CostModel, share_bytes: int, max_batch_size: int, length: int = 1) -> int:
    """Rows per batch for a model: its configured cap, lowered to what its share can hold.

    Returns 0 when even a single row does not fit so the caller can reject such requests
    (HTTP 507) instead of silently running them into an out-of-memory error.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return min(max_batch_size, model.max_rows(share_bytes, length))


@dataclass
class PlanRow:
    """One model's line in the startup memory plan."""

    model: str
    device: str
    weights_bytes: int
    per_unit_bytes: float
    limit: int
    budget_bytes: int
    unit: str = "sample"


def format_bytes(value: float) -> str:
    """Binary-prefixed size, compact enough for a fixed-width log table."""
    if not math.isfinite(value):
        return str(value)
    size = float(value)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or suffix == "TiB":
            return f"{size:.0f} {suffix}" if suffix == "B" else f"{size:.1f} {suffix}"
        size /= 1024
    raise AssertionError("unreachable")


def format_plan(rows: Sequence[PlanRow]) -> str:
    """Fixed-width table so operators can see at a glance why a batch limit is what it is."""
    header = ("model", "device", "weights", "per unit", "limit", "budget")
    body = [
        (
            row.model,
            row.device,
            format_bytes(row.weights_bytes),
            f"{format_bytes(row.per_unit_bytes)}/{row.unit}",
            str(row.limit),
            format_bytes(row.budget_bytes),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    # Text columns read left-aligned, numbers right-aligned.
    align = ["<", "<", ">", ">", ">", ">"]

    def render(line: Sequence[str]) -> str:
        cells = (f"{cell:{a}{w}}" for cell, a, w in zip(line, align, widths, strict=True))
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule, *(render(line) for line in body)])
