"""The memory plan: measure each model's activation cost, budget each device, derive batch limits.

Runs once after every model is loaded (so free memory already excludes all weights) and before any
model reports ready. Profiling forwards run on the device's own thread, because the CPU tracker
sees only the thread that entered it and CUDA peak counters are per device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.memory import (
    CostModel,
    MemoryProbe,
    PlanRow,
    Profile,
    batch_limit,
    device_budget,
    format_bytes,
    format_plan,
    profile_forward,
    share_budget,
)
from nograd.runtime.memory.budget import Demand

logger = logging.getLogger(__name__)

# Token models are budgeted at their longest sequence: a batch of that many tokens fits in memory
# whatever its length mix, because attention's quadratic term is largest at the longest length.
DEFAULT_MAX_SEQUENCE = 512


@dataclass(frozen=True)
class ModelPlan:
    """One model's outcome: its cost model, share of the budget and the limit in its unit."""

    name: str
    profile: Profile
    weights_bytes: int
    share_bytes: int
    limit: int
    unit: str
    reference_length: int
    minimum_bytes: int = 0
    """What its smallest batch needs: one sample, or one sequence at the reference length."""

    @property
    def fits_one(self) -> bool:
        return self.limit >= 1

    def predict_bytes(self, rows: int, cost: int) -> float:
        """Predicted peak for a batch of ``rows`` whose cost (samples or padded tokens) is known."""
        length = max(1, cost // max(rows, 1)) if self.unit == "token" else 1
        return self.profile.model.predict(rows, length)


@dataclass(frozen=True)
class PlanInput:
    name: str
    handler: ModelHandler
    weights_bytes: int
    cap: int
    """``max_batch_size`` (samples) or ``max_batch_tokens`` (tokens): the limit's ceiling."""


def max_sequence_length(handler: ModelHandler) -> int:
    """The longest sequence a token model reads (its truncation length), for budgeting: what the
    handler states, or a BERT-sized default for one that states none."""
    return handler.max_length or DEFAULT_MAX_SEQUENCE


def profile_handler(handler: ModelHandler, probe: MemoryProbe, cap: int) -> Profile:
    """Peak activation bytes over a grid of batch shapes; runs on the caller's (device) thread."""
    runner = TorchRunner(handler)

    def run(rows: int, length: int) -> object:
        # One part per row, as under load: collation then allocates the batch's input buffer,
        # which belongs to the batch's cost.
        example = handler.example(rows, length)
        return runner.run_batch([example.slice(i, i + 1) for i in range(rows)])

    if handler.config.batch_unit == "tokens":
        longest = max_sequence_length(handler)
        lengths = sorted({min(16, longest), min(32, longest), min(64, longest)})
        return profile_forward(run, probe, rows=(1, 2, 4), lengths=lengths, quadratic=True)
    top = max(1, min(cap, 32))
    rows = sorted({1, *(2**k for k in range(1, 6) if 2**k <= top)})
    if len(rows) < 2:
        rows = [1, 2]
    return profile_forward(run, probe, rows=rows)


def plan_device(
    models: Sequence[PlanInput],
    profiles: dict[str, Profile],
    probe: MemoryProbe,
    *,
    fraction: float,
    explicit_bytes: int | None,
) -> tuple[int, list[ModelPlan]]:
    """Budget one device and split it among its models, max-min fair (see ``share_budget``)."""
    budget = device_budget(probe, fraction, explicit_bytes)
    demands = {item.name: demand_of(item, profiles[item.name].model) for item in models}
    shares = share_budget(budget, demands)
    plans = []
    for item in models:
        cost = profiles[item.name].model
        length = _reference_length(item)
        if item.handler.config.batch_unit == "tokens":
            rows = batch_limit(cost, shares[item.name], max(item.cap // length, 1), length)
            limit, unit = min(item.cap, rows * length), "token"
        else:
            limit, unit = batch_limit(cost, shares[item.name], item.cap), "sample"
        plans.append(
            ModelPlan(
                item.name,
                profiles[item.name],
                item.weights_bytes,
                shares[item.name],
                limit,
                unit,
                length,
                demands[item.name].minimum,
            )
        )
    return budget, plans


def demand_of(item: PlanInput, cost: CostModel) -> Demand:
    """Bytes of one row and of a batch at the cap; a token model's rows are sequences at its
    reference length. Rounded up so that a share of that many bytes holds the batch."""
    length = _reference_length(item)
    rows_at_cap = item.cap // length if item.handler.config.batch_unit == "tokens" else item.cap
    return Demand(
        minimum=math.ceil(cost.predict(1, length)),
        at_cap=math.ceil(cost.predict(max(rows_at_cap, 1), length)),
    )


def _reference_length(item: PlanInput) -> int:
    if item.handler.config.batch_unit != "tokens":
        return 1
    return max(1, min(max_sequence_length(item.handler), item.cap))


def per_unit_bytes(cost: CostModel, unit: str, reference_length: int) -> float:
    """Bytes per sample, or per token at the reference length (quadratic term included)."""
    if unit == "token":
        return cost.per_unit + cost.quadratic * reference_length
    return cost.per_unit


def log_plan(device: str, budget: int, plans: Sequence[ModelPlan]) -> None:
    rows = [
        PlanRow(
            p.name,
            device,
            p.weights_bytes,
            per_unit_bytes(p.profile.model, p.unit, p.reference_length),
            p.limit,
            p.share_bytes,
            p.unit,
        )
        for p in plans
    ]
    logger.info(
        "memory plan for %s (budget %s):\n%s", device, format_bytes(budget), format_plan(rows)
    )
    for plan in plans:
        check = plan.profile.check_point
        logger.info(
            "model %s cost model: %.0f B + %.1f B/unit + %.3f B/unit·len; check at rows=%d "
            "len=%d measured %s predicted %s (error %.1f%%)",
            plan.name,
            plan.profile.model.fixed,
            plan.profile.model.per_unit,
            plan.profile.model.quadratic,
            check.rows,
            check.length,
            format_bytes(check.measured_bytes),
            format_bytes(check.predicted_bytes),
            100 * check.relative_error,
        )
        if not plan.fits_one:
            beside = "" if plan.minimum_bytes > budget else " beside the other models' minimums"
            logger.warning(
                "model %s: its smallest batch (%s) needs %s, which does not fit the %s "
                "budget of %s%s; it gets no share and its requests answer 507",
                plan.name,
                _smallest_batch(plan),
                format_bytes(plan.minimum_bytes),
                format_bytes(budget),
                device,
                beside,
            )


def _smallest_batch(plan: ModelPlan) -> str:
    if plan.unit == "token":
        return f"one sequence of {plan.reference_length} tokens"
    return "one sample"
