"""What a request's tensor may declare, checked before any array is built, and how large a request
is before decoding it leaves the event loop: one copy for every front and codec.

A shape comes from the client: numpy cannot describe more than 64 dimensions, nor an empty array
whose other dimensions overflow its index type, and an element count from hostile dimensions can
exceed any machine integer, so the count is computed with Python's unbounded ints and bounded
before numpy sees the shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from nograd.core.errors import DecodeError

MAX_DIMS: Final = 32
"""Most dimensions a tensor may have (numpy 1.x's own limit; no model here needs more)."""
MAX_ELEMENTS: Final = 2**40
"""Most elements a shape may describe, counting only its non-zero dimensions: far beyond any body
the server accepts, far below where numpy's sizes overflow."""
OFFLOAD_DECODE_BYTES: Final = 64 * 1024
"""Decoding a request whose tensors hold more than this takes milliseconds of CPU: it leaves the
event loop for a thread."""


def checked_shape(dims: Sequence[int], where: str) -> tuple[int, ...]:
    """``dims`` as a shape numpy can describe: at most ``MAX_DIMS`` dimensions, none negative, at
    most ``MAX_ELEMENTS`` elements; else a ``DecodeError`` naming the input and the limit."""
    if len(dims) > MAX_DIMS:  # first: the dimensions themselves are not read past the limit
        raise DecodeError(
            f"{where}: shape with {len(dims)} dimensions is too large; the limit is {MAX_DIMS}"
        )
    shape = tuple(dims)
    if min(shape, default=0) < 0:
        raise DecodeError(f"{where}: shape {list(shape)} has a negative dimension")
    if math.prod(shape if 0 not in shape else (d for d in shape if d)) > MAX_ELEMENTS:
        raise DecodeError(
            f"{where}: shape {list(shape)} is too large; the limit is {MAX_ELEMENTS} elements "
            "(2**40, zero dimensions aside)"
        )
    return shape
