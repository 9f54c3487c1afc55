"""``all_finite`` agrees with ``isfinite(array).all()``."""

from __future__ import annotations

import numpy as np
import pytest

from nograd.core.finite import all_finite


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_agrees_with_a_check_of_every_value(dtype: type) -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        values = rng.normal(scale=1e3, size=int(rng.integers(0, 40))).astype(dtype)
        if values.size and rng.random() < 0.5:
            values[rng.integers(values.size)] = rng.choice([np.nan, np.inf, -np.inf])
        assert all_finite(values) is bool(np.isfinite(values).all())


def test_infinities_of_both_signs_and_nan_are_not_finite() -> None:
    assert not all_finite(np.array([np.inf, -np.inf], dtype=np.float32))
    assert all_finite(np.full(8, np.finfo(np.float16).max, dtype=np.float16))
    assert not all_finite(np.array([[1.0], [np.nan]]))
    assert all_finite(np.zeros((0, 3), dtype=np.float32))
