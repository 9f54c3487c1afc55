"""The accuracy guard's comparison: a speed mode's outputs against fp32 eager's, per output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nograd.runtime.handler import Outputs


@dataclass(frozen=True)
class OutputDelta:
    """One output against fp32 eager over every check batch."""

    name: str
    max_abs_error: float | None = None
    """Float outputs: largest absolute difference of any element."""
    min_cosine: float | None = None
    """Float outputs: smallest cosine similarity of one sample's values (flattened)."""
    match_rate: float | None = None
    """Integer and boolean outputs: fraction of elements exactly equal."""


@dataclass(frozen=True)
class AccuracyReport:
    """How far a mode's outputs are from fp32 eager; the guard decides on the float outputs."""

    outputs: tuple[OutputDelta, ...]
    batches: int

    @property
    def max_abs_error(self) -> float:
        errors = [o.max_abs_error for o in self.outputs if o.max_abs_error is not None]
        return _worst(max, errors) if errors else 0.0

    @property
    def min_cosine(self) -> float:
        cosines = [o.min_cosine for o in self.outputs if o.min_cosine is not None]
        return _worst(min, cosines) if cosines else 1.0

    def problems(
        self, tolerance: float, min_cosine: float, min_match_rate: float | None = None
    ) -> list[str]:
        """Why the mode must be refused; empty when it may serve."""
        found = []
        for out in self.outputs:
            rate = out.match_rate
            if rate is not None and min_match_rate is not None and rate < min_match_rate:
                found.append(
                    f"output {out.name!r} matches fp32 eager in {100 * rate:.1f}% of elements, "
                    f"under min_match_rate {100 * min_match_rate:.1f}%"
                )
            error, cosine = out.max_abs_error, out.min_cosine
            if error is not None and not error <= tolerance:  # NaN fails too
                found.append(
                    f"output {out.name!r} max abs error {error:.3g} exceeds "
                    f"accuracy_tolerance {tolerance:.3g}"
                )
            if cosine is not None and not cosine >= min_cosine:
                found.append(
                    f"output {out.name!r} min cosine {cosine:.6f} is below min_cosine "
                    f"{min_cosine:.6f}"
                )
        return found

    def summary(self) -> str:
        parts = []
        for out in self.outputs:
            if out.max_abs_error is not None:
                parts.append(
                    f"{out.name}: max abs error {out.max_abs_error:.3g}, "
                    f"min cosine {out.min_cosine:.6f}"
                )
            elif out.match_rate is not None:
                parts.append(f"{out.name}: exact match {100 * out.match_rate:.1f}%")
        return "; ".join(parts)


def compare(reference: Sequence[Outputs], candidate: Sequence[Outputs]) -> AccuracyReport:
    """Max abs error and min per-sample cosine of float outputs; exact match rate of the rest."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} candidate results for {len(reference)} references")
    if not reference:
        return AccuracyReport((), 0)
    deltas = []
    for name in reference[0]:
        pairs = [(ref[name], cand[name]) for ref, cand in zip(reference, candidate, strict=True)]
        for ref_array, cand_array in pairs:
            if ref_array.shape != cand_array.shape:
                raise ValueError(
                    f"output {name!r} has shape {list(cand_array.shape)}, fp32 eager gave "
                    f"{list(ref_array.shape)}"
                )
        if np.issubdtype(pairs[0][0].dtype, np.floating):
            error = _worst(max, [_max_abs_error(ref, cand) for ref, cand in pairs])
            cosine = _worst(min, [_min_cosine(ref, cand) for ref, cand in pairs])
            deltas.append(OutputDelta(name, max_abs_error=error, min_cosine=cosine))
        else:
            equal = sum(int(np.count_nonzero(ref == cand)) for ref, cand in pairs)
            total = sum(ref.size for ref, _ in pairs)
            deltas.append(OutputDelta(name, match_rate=equal / total if total else 1.0))
    return AccuracyReport(tuple(deltas), len(reference))


def _worst(pick: Callable[[list[float]], float], values: list[float]) -> float:
    """``max``/``min`` where NaN wins: Python's own would drop it depending on the order."""
    return float(np.nan) if any(np.isnan(v) for v in values) else pick(values)


def _max_abs_error(reference: np.ndarray, candidate: np.ndarray) -> float:
    if reference.size == 0:
        return 0.0
    diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    return float(np.nan) if np.isnan(diff).any() else float(diff.max())


def _min_cosine(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Smallest cosine of a sample's flattened values; two all-zero samples count as equal."""
    if reference.size == 0:
        return 1.0
    if np.isnan(reference).any() or np.isnan(candidate).any():
        return float(np.nan)
    ref = reference.reshape(reference.shape[0], -1).astype(np.float64)
    cand = candidate.reshape(candidate.shape[0], -1).astype(np.float64)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    dots = (ref * cand).sum(axis=1)
    both_zero = (np.linalg.norm(ref, axis=1) == 0) & (np.linalg.norm(cand, axis=1) == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = np.where(both_zero, 1.0, np.where(norms > 0, dots / norms, 0.0))
    return float(cosine.min())
