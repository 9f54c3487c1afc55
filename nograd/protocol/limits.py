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

from nograd.core.errors import DecodedTooLarge, DecodeError

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


BYTES_ELEMENT_BYTES: Final = 48
"""Memory a BYTES element takes decoded besides its text: a Python ``bytes`` object and its slot
in the tensor."""
JSON_PARSE_BYTES: Final = 14
"""Memory per byte of a JSON body while it is parsed: the parser's own working copy of the
document (about 13 bytes per byte, whatever it holds), then its texts as Python objects."""
JSON_TOKEN_BYTES: Final = ((b",", 48), (b"[", 64), (b"{", 96), (b'"', 56))
"""Memory each of these characters of a JSON body stands for once it is decoded: a separator,
one value more (a list slot, a number object, its slots in numpy's copy and in the tensor); an
opening bracket or brace, a list or dict; a quote, half a text (a ``str``, then its ``bytes``)."""
JSON_SCAN_SLICE: Final = 1 << 20
"""Bytes of a JSON body scanned at a time: a large body is scanned off the event loop, and the
thread lets go of the interpreter between two slices."""


def json_decoded_bytes(body: bytes | bytearray | memoryview, stop_at: int) -> int:
    """About the most memory the JSON ``body`` takes while its tensors are decoded: the parse
    (``JSON_PARSE_BYTES`` per byte) and each value, list and text by ``JSON_TOKEN_BYTES``, read
    from its characters without parsing it. Once past ``stop_at`` the scan stops (the result is
    then a lower bound above ``stop_at``), so a hostile body costs a few slices of scanning."""
    size = len(body)
    total = JSON_PARSE_BYTES * size + JSON_TOKEN_BYTES[0][1]
    if total > stop_at:  # the parse alone passes it: nothing to scan (nor copy)
        return total
    data = body if isinstance(body, (bytes, bytearray)) else body.tobytes()
    for start in range(0, size, JSON_SCAN_SLICE):
        end = start + JSON_SCAN_SLICE
        total += sum(cost * data.count(token, start, end) for token, cost in JSON_TOKEN_BYTES)
        if total > stop_at:
            break
    return total


def tensor_decoded_bytes(datatype: str, shape: Sequence[int], itemsize: int) -> int:
    """Memory the tensor ``shape`` of ``datatype`` takes decoded, texts aside: its elements,
    a BYTES element counting ``BYTES_ELEMENT_BYTES`` (Python ints: no overflow)."""
    return math.prod(shape) * (BYTES_ELEMENT_BYTES if datatype == "BYTES" else itemsize)


def decoded_too_large(estimate: int, limit: int, what: str) -> DecodedTooLarge:
    """The refusal of a request whose inputs would take ``estimate`` bytes decoded."""
    return DecodedTooLarge(
        f"{what} would take about {estimate} bytes of memory decoded, more than the limit of "
        f"{limit} bytes per request (NOGRAD_MAX_DECODED_BYTES); send large tensors as binary "
        "tensor data (binary_data_size), which decodes to its own size"
    )
