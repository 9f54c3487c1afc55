"""Triton's ``timeout`` parameter, read by one parser for both fronts."""

from __future__ import annotations

import pytest

from nograd.core.errors import DecodeError
from nograd.protocol.request_timeout import timeout_s


def test_microseconds_become_seconds_and_zero_or_absent_leave_the_default() -> None:
    assert timeout_s(2_500_000) == 2.5
    assert timeout_s(1) == 1e-6
    assert timeout_s(0) is None
    assert timeout_s(None) is None


@pytest.mark.parametrize("value", [-1, True, 1.5, "100", [100]])
def test_a_value_that_is_no_count_of_microseconds_is_refused_naming_it(value: object) -> None:
    with pytest.raises(DecodeError) as raised:
        timeout_s(value)
    assert str(raised.value) == (
        f"parameter 'timeout' must be a non-negative integer (µs), got {value!r}"
    )
