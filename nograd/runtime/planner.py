"""The memory plan: measure each model's activation cost, budget each device, derive batch limits.

Runs once after every model is loaded (so free memory already excludes all weights) and before any
model reports ready. Each engine that serves a range of a model's batch sizes is measured the way
it allocates (its ``memory_probe``: the process's resident peak on CPU; torch's allocator, or the
device's free memory for an engine with an arena of its own, on CUDA), its fit checked and
refused when wrong (``nograd.runtime.memory.fits``). Profiling forwards run on the device's own
thread, as batches do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nograd.core.units import format_bytes
from nograd.host.heap import release_free_memory
from nograd.runtime.engines.paths import EnginePath, serving_ranges
from nograd.runtime.handler import TensorPart
from nograd.runtime.memory import (
    CostModel,
    CpuMemoryProbe,
    MemoryProbe,
    Profile,
    batch_limit,
    device_budget,
    profile_forward,
    share_budget,
)
from nograd.runtime.memory.budget import Demand
from nograd.runtime.memory.cost import UNBOUNDED_ROWS, CheckPoint, Cost, Point
from nograd.runtime.memory.fits import (
    FIT_TOLERANCE,
    RangedCost,
    RangeFit,
    Verdict,
    VerifiedFit,
    covering,
    verified_profile,
)
from nograd.runtime.runners import Handler, batch_runner

logger = logging.getLogger(__name__)

# Token models are budgeted at their longest sequence: a batch of that many tokens fits in memory
# whatever its length mix, because attention's quadratic term is largest at the longest length.
DEFAULT_MAX_SEQUENCE = 512
CHECK_REACH = 16
"""A sample model's fit is checked at up to this many times the grid's largest batch (its cap,
when that is nearer)."""
ESTIMATE_MARGIN = 2.0
"""How many times the warm-up's measured bytes per row an estimated cost plans on: the warm-up
runs a few batches on the serving engine, where scratch a profile's fresh session would count
already sits, and its larger batches may grow faster than its few points show."""
NEVER_FITS = UNBOUNDED_ROWS
"""The demand of a model whose one-row batch cannot be served (its engine's fit was refused):
larger than any budget, so it gets no share and its requests answer 507."""


@dataclass(frozen=True)
class ModelPlan:
    """One model's outcome: its cost model, share of the budget and the limit in its unit."""

    name: str
    cost: RangedCost
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
        return self.cost.predict(rows, length)

    @property
    def limit_rows(self) -> int:
        """The limit in rows: samples, or sequences at the reference length."""
        return self.limit // self.reference_length if self.unit == "token" else self.limit

    @property
    def unit_bytes(self) -> float:
        """Bytes per unit of the engine that serves a batch at the limit (the one that binds)."""
        model = self.cost.fit_for(max(1, self.limit_rows)).fit.model
        return per_unit_bytes(model, self.unit, self.reference_length)

    def fit_rows(self) -> list[tuple[str, float, float]]:
        """(engine, planned bytes per unit, signed error at its last check) per range."""
        return [
            (
                item.engine,
                per_unit_bytes(item.fit.model, self.unit, self.reference_length),
                item.fit.errors[-1],
            )
            for item in self.cost.ranges
        ]


@dataclass(frozen=True)
class PlanInput:
    name: str
    handler: Handler
    weights_bytes: int
    cap: int
    """``max_batch_size`` (samples) or ``max_batch_tokens`` (tokens): the limit's ceiling."""


def max_sequence_length(handler: Handler) -> int:
    """The longest sequence a token model reads (its truncation length), for budgeting: what the
    handler states, or a BERT-sized default for one that states none."""
    return handler.max_length or DEFAULT_MAX_SEQUENCE


class ProfileStopped(Exception):
    """A profile given up between two of its measurements (``profile_handler``'s ``stop``)."""


def profile_handler(
    handler: Handler, probe: MemoryProbe, cap: int, stop: Callable[[], bool] | None = None
) -> RangedCost:
    """Peak activation bytes over a grid of batch shapes, fitted and checked, for each engine that
    serves a range of the handler's batch sizes; ``probe`` is the device's. Runs on the caller's
    (device) thread. ``stop``, asked before each measured run, gives the profile up
    (``ProfileStopped``): a profile measured in the background yields to a load."""
    try:
        ranges = [
            RangeFit(engine.name, most, _profile_engine(handler, engine, probe, cap, stop))
            for most, engine in serving_ranges(handler)
        ]
    finally:
        # The largest batches measured leave memory in the engines and the heap: handed back,
        # so serving starts from the idle state the plan's budget is counted above.
        for _, engine in serving_ranges(handler):
            engine.release_memory()
        release_free_memory()
    return RangedCost(tuple(ranges))


def estimated_cost(handler: Handler, points: Sequence[Point]) -> RangedCost | None:
    """A cost to plan on before the profile: the bound of ``points`` (the warm-up's batches,
    measured as they ran), its bytes per row times ``ESTIMATE_MARGIN``, for every engine range;
    None for a token model (its plan reaches lengths no warm-up batch ran) or without points."""
    if handler.config.batch_unit == "tokens" or not points:
        return None
    bound = covering(points, quadratic=False)
    model = CostModel(bound.fixed, ESTIMATE_MARGIN * bound.per_unit)
    rows, length, measured = max(points)
    check = CheckPoint(rows, length, measured, model.predict(rows, length))
    fit = VerifiedFit(Profile(tuple(points), bound, check), Verdict.ESTIMATED, (0.0,), model)
    return RangedCost(
        tuple(RangeFit(path.name, most, fit) for most, path in serving_ranges(handler))
    )


def _profile_engine(
    handler: Handler,
    engine: EnginePath,
    probe: MemoryProbe,
    cap: int,
    stop: Callable[[], bool] | None = None,
) -> VerifiedFit:
    """``engine`` measured through its own probe over every batch size of the grid: a fit over
    sizes outside its range too is still that engine's cost, and needs no narrower grid."""
    runner = batch_runner(handler, path=engine)
    measured = engine.memory_probe(probe)
    ready: dict[tuple[int, int], list[TensorPart]] = {}

    def prepare(rows: int, length: int) -> list[TensorPart]:
        # One part per row, as under load: collation then allocates the batch's input buffer,
        # which belongs to the batch's cost; the parts, as requests bring them, do not.
        if (rows, length) not in ready:
            ready.clear()
            example = handler.example(rows, length)
            ready[(rows, length)] = [example.slice(i, i + 1) for i in range(rows)]
        return ready[(rows, length)]

    def run(rows: int, length: int) -> object:
        if stop is not None and stop():
            raise ProfileStopped(f"profile of {handler.config.name} given up")
        return runner.run_batch(prepare(rows, length))

    def measure(rows: int, length: int) -> int:
        prepare(rows, length)
        return measured.measure_peak(lambda: run(rows, length))

    tokens = handler.config.batch_unit == "tokens"
    if tokens:
        # The grid reaches the longest sequence, where the plan budgets token batches and where
        # attention's quadratic term shows; the check sits between the grid's lengths, at more
        # rows than it measured.
        longest = max_sequence_length(handler)
        rows: Sequence[int] = (1, 2, 4)
        lengths = sorted({min(16, longest), min(64, longest), longest})
        check = (6, max(2, (lengths[-2] + lengths[-1]) // 2)) if len(lengths) > 1 else None
    else:
        top = max(1, min(cap, 32))
        rows = sorted({1, *(2**k for k in range(1, 6) if 2**k <= top)}) if top > 1 else [1, 2]
        # Checked towards the cap, where the limit may take the plan: memory can grow faster
        # than the small batches of the grid show (larger kernels, larger scratch).
        lengths, check = [1], (max(rows[-1] + 1, min(cap, CHECK_REACH * rows[-1])), 1)

    def profile() -> Profile:
        return profile_forward(run, measured, rows, lengths, check, tokens, prepare)

    return verified_profile(profile, measure, quadratic=tokens)


def plan_device(
    models: Sequence[PlanInput],
    profiles: dict[str, RangedCost],
    probe: MemoryProbe,
    *,
    fraction: float,
    explicit_bytes: int | None,
) -> tuple[int, list[ModelPlan]]:
    """Budget one device and split it among its models, max-min fair (see ``share_budget``)."""
    budget = device_budget(probe, fraction, explicit_bytes)
    demands = {item.name: demand_of(item, profiles[item.name]) for item in models}
    shares = share_budget(budget, demands)
    plans = []
    for item in models:
        cost = profiles[item.name]
        length = _reference_length(item)
        if item.handler.config.batch_unit == "tokens":
            rows = batch_limit(cost, shares[item.name], max(item.cap // length, 1), length)
            limit, unit = min(item.cap, rows * length), "token"
        else:
            limit, unit = batch_limit(cost, shares[item.name], item.cap), "sample"
        plans.append(
            ModelPlan(
                item.name,
                cost,
                item.weights_bytes,
                shares[item.name],
                limit,
                unit,
                length,
                demands[item.name].minimum,
            )
        )
    return budget, plans


def demand_of(item: PlanInput, cost: Cost) -> Demand:
    """Bytes of one row and of a batch at the cap; a token model's rows are sequences at its
    reference length. Rounded up so that a share of that many bytes holds the batch."""
    length = _reference_length(item)
    rows_at_cap = item.cap // length if item.handler.config.batch_unit == "tokens" else item.cap
    # A range whose engine was refused serves nothing: the largest batch is below it.
    largest = min(max(rows_at_cap, 1), cost.max_rows(math.inf, length))
    if largest < 1:
        return Demand(NEVER_FITS, NEVER_FITS)
    return Demand(
        minimum=math.ceil(cost.predict(1, length)),
        at_cap=math.ceil(cost.predict(largest, length)),
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


def log_plan(
    device: str, budget: int, plans: Sequence[ModelPlan], level: int = logging.INFO
) -> None:
    """The plan as a table (one row per model and engine range: why each limit is what it is,
    on which engine's measurement and how good a fit), then each fit's numbers at debug level;
    a fit refused, or a model that fits no batch, is a warning whatever ``level``."""
    rows = [
        {
            "model": p.name,
            "device": device,
            "weights_bytes": p.weights_bytes,
            "engine": _range_label(item),
            "unit": p.unit,
            "per_unit_bytes": round(per_unit_bytes(item.fit.model, p.unit, p.reference_length)),
            "fit": f"{item.fit.verdict} {100 * item.fit.errors[-1]:+.1f}%",
            "limit": p.limit,
            "share_bytes": p.share_bytes,
        }
        for p in plans
        for item in p.cost.ranges
    ]
    logger.log(level, "memory plan for %s", device, extra={"budget_bytes": budget, "table": rows})
    for plan in plans:
        for item in plan.cost.ranges:
            _log_fit(plan.name, item)
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


def _range_label(item: RangeFit) -> str:
    return item.engine if item.most_rows is None else f"{item.engine}<={item.most_rows}"


def _log_fit(model: str, item: RangeFit) -> None:
    fit, check = item.fit, item.fit.profile.check_point
    errors = ", ".join(f"{100 * error:+.1f}%" for error in fit.errors)
    logger.log(
        logging.WARNING if fit.refused else logging.DEBUG,
        "model %s on %s: cost model %.0f B + %.1f B/unit + %.3f B/unit·len; check at rows=%d "
        "len=%d measured %s predicted %s; %s (check errors %s, tolerance %.0f%%)%s",
        model,
        _range_label(item),
        fit.model.fixed,
        fit.model.per_unit,
        fit.model.quadratic,
        check.rows,
        check.length,
        format_bytes(check.measured_bytes),
        format_bytes(check.predicted_bytes),
        fit.verdict,
        errors,
        100 * FIT_TOLERANCE,
        "; its memory is unpredictable, so it serves no batch of this range" if fit.refused else "",
    )
    logger.debug(
        "model %s on %s: measured (rows, length, bytes) %s",
        model,
        _range_label(item),
        list(fit.profile.points),
    )


def _smallest_batch(plan: ModelPlan) -> str:
    if plan.unit == "token":
        return f"one sequence of {plan.reference_length} tokens"
    return "one sample"


def warm_memory_probe() -> None:
    """Measure one tiny operation, so this process imports what measuring a model's activation
    memory brings in (torch's dispatch machinery) now, at start-up, rather than at the first
    model loaded later, where it would count as that model's memory."""
    CpuMemoryProbe().measure_peak(lambda: torch.zeros(2) + 1)
