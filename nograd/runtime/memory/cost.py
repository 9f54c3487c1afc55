"""The cost model: a forward's peak extra memory measured at a few batch shapes and fitted, so
the batcher sizes batches from measurement, not from guesses about the model."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np

from nograd.runtime.memory.probes import MemoryProbe

# A point measured by the profiler: (rows, padded length, peak extra bytes).
Point = tuple[int, int, int]

# Returned by CostModel.max_rows when memory does not bound the batch at all.
UNBOUNDED_ROWS: Final = 1 << 62


class Cost(Protocol):
    """What the budget needs of a cost: a batch's predicted peak, and the rows a budget holds."""

    def predict(self, rows: int, length: int = 1) -> float: ...

    def max_rows(self, budget_bytes: float, length: int = 1) -> int: ...


@dataclass(frozen=True)
class CostModel:
    """Peak extra bytes of one forward as a function of the batch shape.

    ``bytes = fixed + per_unit * (rows * length) + quadratic * (rows * length**2)``.

    For plain models ``length`` is 1, so ``per_unit`` is bytes per sample.  For sequence
    models ``rows * length`` is the padded token count, ``per_unit`` is bytes per token, and
    the quadratic term captures attention-like score matrices (``rows * L * L``).
    """

    fixed: float
    per_unit: float
    quadratic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed", "per_unit", "quadratic"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    def per_row(self, length: int = 1) -> float:
        """Marginal bytes of one more row at this padded length."""
        _check_length(length)
        return self.per_unit * length + self.quadratic * length * length

    def predict(self, rows: int, length: int = 1) -> float:
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        return self.fixed + rows * self.per_row(length)

    def max_rows(self, budget_bytes: float, length: int = 1) -> int:
        """Largest row count whose predicted peak fits the budget; 0 if not even one row.

        A model with no per-row cost is bounded only by the caller's max batch size, so it
        reports :data:`UNBOUNDED_ROWS` rather than infinity (callers take a min).
        """
        slope = self.per_row(length)
        if math.isnan(budget_bytes) or self.predict(1, length) > budget_bytes:
            return 0
        if slope <= 0 or math.isinf(budget_bytes):
            return UNBOUNDED_ROWS
        rows = max(1, math.floor((budget_bytes - self.fixed) / slope))
        if rows > 2**52:
            # Beyond float precision "exact" is meaningless, and no batch is this large.
            return min(rows, UNBOUNDED_ROWS)
        # Float division can land one off either way at exact boundaries; settle it exactly.
        while rows > 1 and self.predict(rows, length) > budget_bytes:
            rows -= 1
        while self.predict(rows + 1, length) <= budget_bytes:
            rows += 1
        return rows

    def max_tokens(self, budget_bytes: float, length: int) -> int:
        """Padded token capacity at this length: what a sequence batcher actually packs."""
        return self.max_rows(budget_bytes, length) * length


def _check_length(length: int) -> None:
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")


def fit_cost_model(points: Sequence[Point], quadratic: bool) -> CostModel:
    """Least-squares fit of :class:`CostModel` with non-negative coefficients.

    Negative coefficients are physically meaningless and would make ``max_rows`` blow up, so
    the fit is an exact NNLS: with at most three columns, every subset of columns is solved
    by plain least squares and the best feasible (all >= 0) solution wins.
    """
    if not points:
        raise ValueError("need at least one measured point")
    rows = np.array([p[0] for p in points], dtype=np.float64)
    lengths = np.array([p[1] for p in points], dtype=np.float64)
    measured = np.array([p[2] for p in points], dtype=np.float64)
    if (rows < 1).any() or (lengths < 1).any():
        raise ValueError("rows and lengths must be >= 1")

    columns = [np.ones_like(rows), rows * lengths]
    if quadratic:
        columns.append(rows * lengths * lengths)
    design = np.stack(columns, axis=1)
    # Columns differ by orders of magnitude (1 vs n*L*L); scale them for a well-posed solve.
    scale = np.abs(design).max(axis=0)
    scaled = design / scale
    if np.linalg.matrix_rank(scaled) < design.shape[1]:
        hint = " (quadratic fits need at least two lengths)" if quadratic else ""
        raise ValueError(f"points do not determine {design.shape[1]} coefficients{hint}")

    best: tuple[float, np.ndarray] | None = None
    ncols = design.shape[1]
    for size in range(1, ncols + 1):
        for subset in itertools.combinations(range(ncols), size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], measured, rcond=None)
            if (solution < 0).any():
                continue
            coef = np.zeros(ncols)
            coef[cols] = solution
            residual = float(np.sum((scaled @ coef - measured) ** 2))
            if best is None or residual < best[0]:
                best = (residual, coef)
    coef = best[1] / scale if best is not None else np.zeros(ncols)
    return CostModel(
        fixed=float(coef[0]),
        per_unit=float(coef[1]),
        quadratic=float(coef[2]) if quadratic else 0.0,
    )


@dataclass(frozen=True)
class CheckPoint:
    """A shape measured *after* the fit, to show how far the model can be trusted."""

    rows: int
    length: int
    measured_bytes: int
    predicted_bytes: float

    @property
    def relative_error(self) -> float:
        return abs(self.signed_error)

    @property
    def signed_error(self) -> float:
        """(predicted - measured) / measured: below zero the fit promises less than was used."""
        if self.measured_bytes == 0:
            return 0.0 if self.predicted_bytes == 0 else math.inf
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass
class Profile:
    """Everything learned about one model's memory, kept for the startup log and metrics."""

    points: tuple[Point, ...]
    model: CostModel
    check_point: CheckPoint

    @property
    def relative_error(self) -> float:
        return self.check_point.relative_error


def _default_check(rows: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    # Planning extrapolates beyond the profiled grid (up to max batch size), so check there.
    top = max(rows)
    return max(top + 1, top * 3 // 2), max(lengths)


def profile_forward(
    run: Callable[[int, int], object],
    probe: MemoryProbe,
    rows: Sequence[int],
    lengths: Sequence[int] = (1,),
    check: tuple[int, int] | None = None,
    quadratic: bool = False,
    prepare: Callable[[int, int], object] | None = None,
) -> Profile:
    """Measures ``run(rows, length)`` over the grid, fits a cost model and validates it.

    ``run`` must build the batch itself (collation buffers are part of the real cost) and
    should run under ``torch.inference_mode()`` like serving does, since autograd would keep
    every activation alive and inflate the numbers.  One warm-up call, measured and discarded,
    comes first so lazily initialised state (workspaces, caches) is not billed to the first
    shape.
    ``prepare(rows, length)``, when given, runs unmeasured before each measured shape: the
    inputs a request brings exist before its batch runs, so they are built there, not billed.
    """
    if not rows or not lengths:
        raise ValueError("rows and lengths must be non-empty")
    if min(rows) < 1 or min(lengths) < 1:
        raise ValueError("rows and lengths must be >= 1")
    grid = [(n, length) for n in rows for length in lengths]
    check_rows, check_length = check if check is not None else _default_check(rows, lengths)
    if (check_rows, check_length) in grid:
        raise ValueError(f"check point {(check_rows, check_length)} is part of the fit grid")

    def measure(n: int, length: int) -> int:
        if prepare is not None:
            prepare(n, length)
        return probe.measure_peak(lambda: run(n, length))

    # Through the probe, so what the probe itself sets up on first use is not billed either.
    if prepare is not None:
        prepare(min(rows), min(lengths))
    probe.measure_peak(lambda: run(min(rows), min(lengths)))
    points = tuple((n, length, measure(n, length)) for n, length in grid)
    model = fit_cost_model(points, quadratic=quadratic)
    checkpoint = CheckPoint(
        rows=check_rows,
        length=check_length,
        measured_bytes=measure(check_rows, check_length),
        predicted_bytes=model.predict(check_rows, check_length),
    )
    return Profile(points=points, model=model, check_point=checkpoint)
