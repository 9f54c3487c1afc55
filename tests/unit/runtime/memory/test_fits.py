"""The fits a plan may use: taken, measured again, bounded or refused by their checks; and a cost
made of one fit per range of batch sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from nograd.runtime.memory import UNBOUNDED_ROWS, CheckPoint, CostModel, Profile
from nograd.runtime.memory.fits import (
    NOISE_BYTES,
    RangedCost,
    RangeFit,
    Verdict,
    VerifiedFit,
    covering,
    verified_profile,
)

KIB = 1024
"""The checks below miss by far more than a peak's noise (NOISE_BYTES), so their errors count."""
LINEAR = CostModel(fixed=1000 * KIB, per_unit=100 * KIB)


def profile_checked(measured_at_check: int) -> Profile:
    """A linear fit over rows 1..8 whose check at 12 rows measured ``measured_at_check``."""
    points = tuple((rows, 1, int(LINEAR.predict(rows))) for rows in (1, 2, 4, 8))
    return Profile(points, LINEAR, CheckPoint(12, 1, measured_at_check, LINEAR.predict(12)))


def scripted(*profiles: Profile) -> Callable[[], Profile]:
    calls: Iterator[Profile] = iter(profiles)
    return lambda: next(calls)


def never(rows: int, length: int) -> int:
    raise AssertionError("a fit that held needs no further measure")


def test_a_fit_within_tolerance_is_taken_and_planned_at_no_less_than_measured() -> None:
    fit = verified_profile(scripted(profile_checked(2300 * KIB)), never, quadratic=False)
    assert fit.verdict is Verdict.FITS
    assert fit.errors == (pytest.approx((2200 - 2300) / 2300),)
    assert fit.profile.model == LINEAR
    # The check measured 100 KiB more than the line: the plan covers it.
    assert fit.model.predict(12) >= 2300 * KIB
    assert fit.model.per_unit == pytest.approx(LINEAR.per_unit, rel=0.1)


def test_a_fit_off_once_is_measured_again() -> None:
    fit = verified_profile(
        scripted(profile_checked(9000 * KIB), profile_checked(2200 * KIB)), never, quadratic=False
    )
    assert fit.verdict is Verdict.REMEASURED
    assert fit.errors[0] < -0.25 and fit.errors[1] == 0.0


def test_a_fit_off_twice_is_bounded_by_every_point_and_checked_further() -> None:
    further: list[tuple[int, int]] = []

    def measure(rows: int, length: int) -> int:
        further.append((rows, length))
        return rows * 700 * KIB  # 700 KiB a row, as the checks said

    fit = verified_profile(
        scripted(profile_checked(8400 * KIB), profile_checked(8400 * KIB)), measure, quadratic=False
    )
    assert fit.verdict is Verdict.BOUNDED
    assert further == [(10, 1)]  # between the grid's largest batch (8) and the check's (12)
    assert len(fit.errors) == 3
    for rows, length, used in fit.profile.points:
        assert fit.model.predict(rows, length) >= used
    assert fit.errors[-1] >= -0.25


def test_a_bound_that_still_falls_short_is_refused() -> None:
    fit = verified_profile(
        scripted(profile_checked(8400 * KIB), profile_checked(8400 * KIB)),
        lambda rows, length: 10**9,  # memory that no fit of the grid foresaw
        quadratic=False,
    )
    assert fit.verdict is Verdict.REFUSED and fit.refused
    assert fit.errors[-1] < -0.25


def test_a_bound_short_by_less_than_the_noise_is_raised_not_refused() -> None:
    """A small model's further check, under its bound by a third but by fewer bytes than a
    process peak moves on its own: the model serves, planned on a bound covering that point."""
    small = CostModel(fixed=100 * KIB, per_unit=10 * KIB)
    points = tuple((rows, 1, int(small.predict(rows))) for rows in (1, 2, 4, 8))
    over = int(small.predict(12)) + 1024 * KIB  # off twice by more than the noise
    off = Profile(points, small, CheckPoint(12, 1, over, small.predict(12)))
    further = 1536 * KIB  # the bound says about 1093 KiB at 10 rows
    fit = verified_profile(scripted(off, off), lambda rows, length: further, quadratic=False)
    assert fit.errors[-1] < -0.25
    assert further - 1093 * KIB < NOISE_BYTES
    assert fit.verdict is Verdict.BOUNDED and not fit.refused
    assert fit.model.predict(10) >= further


def test_a_miss_within_the_noise_of_the_measure_is_taken_as_measured() -> None:
    """Off by half at the check, but by fewer bytes than a process peak moves on its own (pages,
    what the heap keeps): no second profile, and the plan still covers what was measured."""
    small = CostModel(fixed=4 * KIB, per_unit=100)
    points = tuple((rows, 1, int(small.predict(rows))) for rows in (1, 2, 4, 8))
    check = CheckPoint(12, 1, 12 * KIB, small.predict(12))
    assert abs(check.predicted_bytes - check.measured_bytes) < NOISE_BYTES
    fit = verified_profile(scripted(Profile(points, small, check)), never, quadratic=False)
    assert fit.verdict is Verdict.FITS
    assert fit.errors[0] < -0.25
    assert fit.model.predict(12) >= 12 * KIB


def test_the_covering_cost_lies_above_every_point() -> None:
    points = [(1, 1, 0), (2, 1, 0), (4, 1, 5000), (64, 1, 90_000)]
    bound = covering(points, quadratic=False)
    assert all(bound.predict(r, n) >= used for r, n, used in points)


def ranged(*ranges: tuple[str, int | None, CostModel, Verdict]) -> RangedCost:
    return RangedCost(
        tuple(
            RangeFit(
                engine,
                most,
                VerifiedFit(Profile((), model, CheckPoint(1, 1, 1, 1.0)), verdict, (0.0,), model),
            )
            for engine, most, model, verdict in ranges
        )
    )


def test_each_batch_size_costs_what_its_ranges_engine_measured() -> None:
    cost = ranged(
        ("onnx", 4, CostModel(0, 1000), Verdict.FITS),
        ("eager", None, CostModel(0, 100), Verdict.FITS),
    )
    assert cost.predict(4) == 4000
    assert cost.predict(5) == 500
    # 4000 bytes hold 4 rows of onnx, and every size above on eager up to 40 rows.
    assert cost.max_rows(4000) == 40
    # 3000 bytes do not hold onnx's 4 rows: the limit stops inside the first range.
    assert cost.max_rows(3000) == 3
    assert cost.max_rows(float("inf")) == UNBOUNDED_ROWS


def test_a_refused_range_serves_no_batch_and_nothing_above_it() -> None:
    cost = ranged(
        ("eager", 8, CostModel(0, 100), Verdict.FITS),
        ("onnx", None, CostModel(0, 1), Verdict.REFUSED),
    )
    assert cost.max_rows(10**9) == 8
    assert cost.predict(9) == float("inf")
    first_refused = ranged(("onnx", None, CostModel(0, 1), Verdict.REFUSED))
    assert first_refused.max_rows(10**9) == 0


def test_ranges_must_ascend_and_end_open() -> None:
    with pytest.raises(ValueError, match="open range"):
        ranged(("onnx", 4, LINEAR, Verdict.FITS))
    with pytest.raises(ValueError, match="ascend"):
        ranged(
            ("onnx", 8, LINEAR, Verdict.FITS),
            ("aoti", 4, LINEAR, Verdict.FITS),
            ("eager", None, LINEAR, Verdict.FITS),
        )
