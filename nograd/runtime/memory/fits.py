"""The fits a plan may use: each checked at a shape it was not fitted on, and one that the check
shows wrong is measured again, bounded from above, or refused, never planned on as it is. A
model whose batch sizes are served by different engines has one fit per range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from nograd.runtime.memory.cost import (
    UNBOUNDED_ROWS,
    CheckPoint,
    CostModel,
    Point,
    Profile,
    fit_cost_model,
)

FIT_TOLERANCE: Final = 0.25
"""Largest relative error at the check point of a fit the plan takes as it is."""
NOISE_BYTES: Final = 512 * 1024
"""A check that misses by less than this cannot judge a fit: the process's resident peak moves by
pages and by what the heap happens to keep at that size. Such a fit is taken as measured (raised
to cover every point, the check's included), without measuring again."""


class Verdict(StrEnum):
    """What became of a fit after its check."""

    FITS = "fits"
    """Within the tolerance at the first check, or off by less than the measure's noise."""
    REMEASURED = "re-measured"
    """Off at the first check, within the tolerance when measured again."""
    BOUNDED = "bounded"
    """Off twice: planned on the bound of every point measured, checked once more at a batch it
    was not fitted on (where it may promise more than is used, never less beyond the
    tolerance, or than the measure's noise)."""
    REFUSED = "refused"
    """Off twice, and the bound too: the engine serves no batch of its range."""
    ESTIMATED = "estimated"
    """Not profiled yet: the bound of the warm-up's own batches, measured as they ran, with a
    margin; a model loaded on demand answers on it while its profile is measured later."""


@dataclass(frozen=True)
class VerifiedFit:
    """A fit, how far its checks trust it, and the cost the plan uses."""

    profile: Profile
    """The points, the fitted model and its last check."""
    verdict: Verdict
    errors: tuple[float, ...]
    """Signed error at the check point of each attempt, in order: (predicted - measured) /
    measured, below zero when the fit promised less than was used."""
    model: CostModel
    """What the plan uses: the fit raised until no measured point, the checks included, lies
    above it; a trusted fit is still planned at no less than what was measured."""

    @property
    def refused(self) -> bool:
        return self.verdict is Verdict.REFUSED


def verified_profile(
    profile: Callable[[], Profile],
    measure: Callable[[int, int], int],
    quadratic: bool,
    tolerance: float = FIT_TOLERANCE,
) -> VerifiedFit:
    """The result of ``profile`` (``profile_forward`` over a grid, run again when asked) that the
    plan may use, by the rules of :class:`Verdict`; ``measure(rows, length)`` measures one more
    shape, to check a bound."""
    first = profile()
    measured = (*first.points, _as_point(first.check_point))
    check = first.check_point
    if first.relative_error <= tolerance or abs(check.predicted_bytes - check.measured_bytes) < (
        NOISE_BYTES
    ):
        planned = covering(measured, quadratic)
        return VerifiedFit(first, Verdict.FITS, (first.check_point.signed_error,), planned)
    second = profile()
    errors = (first.check_point.signed_error, second.check_point.signed_error)
    measured = (*measured, *second.points, _as_point(second.check_point))
    bound = covering(measured, quadratic)
    if second.relative_error <= tolerance:
        return VerifiedFit(second, Verdict.REMEASURED, errors, bound)
    further_rows, further_length = _further(second)
    used = measure(further_rows, further_length)
    last = CheckPoint(
        further_rows, further_length, used, bound.predict(further_rows, further_length)
    )
    # A shortfall within the measure's noise cannot judge the bound either: it is raised to
    # cover that point too, as the first check's noise rule does.
    noise = last.measured_bytes - last.predicted_bytes < NOISE_BYTES
    verdict = Verdict.BOUNDED if last.signed_error >= -tolerance or noise else Verdict.REFUSED
    if noise:
        measured = (*measured, _as_point(last))
        bound = covering(measured, quadratic)
    checked = Profile(measured, bound, last)
    return VerifiedFit(checked, verdict, (*errors, last.signed_error), bound)


def _further(profile: Profile) -> tuple[int, int]:
    """A shape neither the grid nor the check measured: between the grid's largest batch and
    the check's, where the bound interpolates (beyond the check when they are neighbours)."""
    check = profile.check_point
    top = max(rows for rows, _, _ in profile.points)
    between = (top + check.rows) // 2
    return (between if between not in (top, check.rows) else 2 * check.rows), check.length


def _as_point(check: CheckPoint) -> Point:
    return (check.rows, check.length, check.measured_bytes)


def covering(points: Sequence[Point], quadratic: bool) -> CostModel:
    """The least-squares fit of ``points`` raised by its largest shortfall, so no point lies
    above it: measured memory grows faster at large batches than a line through small ones."""
    fit = fit_cost_model(points, quadratic)
    short = max([0.0, *(m - fit.predict(r, n) for r, n, m in points)])
    return CostModel(fit.fixed + short, fit.per_unit, fit.quadratic)


@dataclass(frozen=True)
class RangeFit:
    """The fit of the engine that serves one range of batch sizes (rows)."""

    engine: str
    most_rows: int | None
    """The range's largest batch; None for the last range, which takes every larger one."""
    fit: VerifiedFit


@dataclass(frozen=True)
class RangedCost:
    """A model's cost when each range of batch sizes has its own engine, and so its own fit: a
    batch costs what its range's fit predicts, and a budget holds a batch size only when every
    smaller one fits too (the batcher forms any size up to the limit)."""

    ranges: tuple[RangeFit, ...]

    def __post_init__(self) -> None:
        if not self.ranges or self.ranges[-1].most_rows is not None:
            raise ValueError("ranges must end with an open range (most_rows None)")
        tops = [r.most_rows for r in self.ranges[:-1]]
        bounded = [top for top in tops if top is not None]
        if len(bounded) != len(tops) or bounded != sorted(set(bounded)):
            raise ValueError(f"ranges must ascend, got {tops}")

    def fit_for(self, rows: int) -> RangeFit:
        for item in self.ranges:
            if item.most_rows is None or rows <= item.most_rows:
                return item
        raise AssertionError("unreachable: the last range is open")

    def predict(self, rows: int, length: int = 1) -> float:
        item = self.fit_for(max(rows, 1))
        return math.inf if item.fit.refused else item.fit.model.predict(rows, length)

    def max_rows(self, budget_bytes: float, length: int = 1) -> int:
        """Largest batch whose range's fit, and every smaller batch's, fits the budget; 0 if
        not even one row (or the first range's engine was refused)."""
        held = 0
        for item in self.ranges:
            if item.fit.refused:
                return held
            rows = item.fit.model.max_rows(budget_bytes, length)
            top = UNBOUNDED_ROWS if item.most_rows is None else item.most_rows
            if rows <= held:
                return held
            if rows < top:
                return rows
            held = top
        return held
