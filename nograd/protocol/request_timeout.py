"""Triton's per-request ``timeout`` parameter: the request's own deadline, in microseconds, sent
among a V2 JSON request's ``parameters`` or as a gRPC request's typed parameter. Both fronts read
it here, so a value means the same, or is refused in the same words, whichever way it came."""

from __future__ import annotations

from typing import Final

from nograd.core.errors import DecodeError

PARAMETER: Final = "timeout"


def timeout_s(value: object) -> float | None:
    """The parameter's value in seconds; None when it is absent or 0 (the server's default
    deadline applies). Anything but a non-negative integer is a ``DecodeError`` naming it."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DecodeError(
            f"parameter '{PARAMETER}' must be a non-negative integer (µs), got {value!r}"
        )
    return value / 1e6 if value else None
