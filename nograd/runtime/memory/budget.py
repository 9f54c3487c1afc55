"""Budgets: the device memory given to batches, its share per model, and each model's batch
limit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nograd.runtime.memory.cost import Cost
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


@dataclass(frozen=True)
class Demand:
    """What one model asks of its device's budget, in bytes: the smallest batch it can serve
    (one sample, or one sequence of a token model) and its largest (a batch at its cap)."""

    minimum: int
    at_cap: int

    def __post_init__(self) -> None:
        if self.minimum < 0 or self.at_cap < self.minimum:
            raise ValueError(f"need 0 <= minimum <= at_cap, got {self.minimum}, {self.at_cap}")


def share_budget(budget: int, demands: Mapping[str, Demand]) -> dict[str, int]:
    """Splits a device budget among its models, max-min fair.

    Models are admitted smallest minimum first while their minimums fit together; one left out
    gets 0 (its requests answer 507) rather than a share too small for anything, which would
    also starve the others. Each admitted model gets its minimum, then every share rises to a
    common level, a model stopping at what it uses at its cap so the rest goes to the others.
    No share exceeds its model's cap, and together they never exceed the budget.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    shares = dict.fromkeys(demands, 0)
    admitted: dict[str, Demand] = {}
    reserved = 0
    for name in sorted(demands, key=lambda name: (demands[name].minimum, name)):
        if reserved + demands[name].minimum > budget:
            break
        admitted[name] = demands[name]
        reserved += demands[name].minimum
    if not admitted:
        return shares
    spent_at = _spent_at_level(admitted)
    top = max(demand.at_cap for demand in admitted.values())
    if spent_at(top) <= budget:
        # Every admitted model runs at its cap; what is left over no model could use.
        for name, demand in admitted.items():
            shares[name] = demand.at_cap
        return shares
    # The highest level whose shares fit: spent_at(low) <= budget < spent_at(high).
    low, high = 0, top
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if spent_at(middle) <= budget else (low, middle)
    for name, demand in admitted.items():
        shares[name] = _clamp(low, demand)
    # Fewer bytes are left than models still rising at this level: one more byte each, by name.
    rising = sorted(name for name, d in admitted.items() if d.minimum <= low < d.at_cap)
    for name in rising[: budget - spent_at(low)]:
        shares[name] += 1
    return shares


def _clamp(level: int, demand: Demand) -> int:
    return max(demand.minimum, min(level, demand.at_cap))


def _spent_at_level(demands: Mapping[str, Demand]) -> Callable[[int], int]:
    """Bytes handed out when every share is its model's demand clamped to ``level``."""

    def spent(level: int) -> int:
        return sum(_clamp(level, demand) for demand in demands.values())

    return spent


def batch_limit(model: Cost, share_bytes: int, max_batch_size: int, length: int = 1) -> int:
    """Rows per batch for a model: its configured cap, lowered to what its share can hold.

    Returns 0 when even a single row does not fit so the caller can reject such requests
    (HTTP 507) instead of silently running them into an out-of-memory error.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return min(max_batch_size, model.max_rows(share_bytes, length))
