"""HTTP content codings of inference bodies (RFC 9110): ``gzip`` and ``deflate`` (the zlib
format, as tritonclient sends it), inflated a bounded piece at a time and compressed for clients
that accept them.

A compressed body says nothing true about its inflated size (a megabyte of gzip can hold a
gigabyte of zeros), so inflation is a loop of pieces of at most ``PIECE_BYTES``, the caller
counting each against its limit and its memory budget before asking for the next: a bomb is refused
after at most the limit's worth of output, never held whole.
"""

from __future__ import annotations

import zlib
from typing import Final

from nograd.core.errors import DecodeError

PIECE_BYTES: Final = 1 << 20
"""Most output one inflation step produces."""
MOST_RATIO: Final = 1032
"""deflate's largest expansion: a body this many times smaller than a piece inflates in one."""
ENCODINGS: Final = ("gzip", "deflate")
_WBITS: Final = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class InflatedTooLarge(DecodeError):
    """A compressed body whose inflated size passes the request limit: 413, as an oversized body."""

    status = 413


def request_encoding(header: str | None) -> str | None:
    """The body's coding from ``Content-Encoding`` (``None``: sent as is), or a clear refusal."""
    encoding = (header or "identity").strip().lower()
    if encoding == "identity":
        return None
    if encoding not in _WBITS:
        raise DecodeError(
            f"Content-Encoding {encoding[:32]!r} is not supported; send gzip, deflate or identity"
        )
    return encoding


class Inflater:
    """One compressed body inflated by ``step`` calls, each giving at most ``PIECE_BYTES``."""

    def __init__(self, body: bytes | bytearray | memoryview, encoding: str) -> None:
        self._inflater = zlib.decompressobj(_WBITS[encoding])
        self._pending: bytes | bytearray | memoryview = body
        self._encoding = encoding
        self.done = False

    def step(self) -> bytes:
        """The next piece of the inflated body; ``done`` is set after the last one."""
        try:
            piece = self._inflater.decompress(self._pending, PIECE_BYTES)
        except zlib.error as exc:
            message = f"the request body is not valid {self._encoding} data: {exc}"
            raise DecodeError(message) from exc
        self._pending = self._inflater.unconsumed_tail
        if self._inflater.eof:
            if self._inflater.unused_data:
                raise DecodeError(
                    f"the request body has data after the end of its {self._encoding} stream"
                )
            self.done = True
        elif not self._pending and len(piece) < PIECE_BYTES:
            raise DecodeError(f"the request body's {self._encoding} stream is cut short")
        return piece


def too_large(limit: int) -> InflatedTooLarge:
    return InflatedTooLarge(
        f"request body exceeds the limit of {limit} bytes once decompressed "
        "(NOGRAD_MAX_REQUEST_BYTES)"
    )


def response_encoding(header: str | None) -> str | None:
    """The coding to answer in from ``Accept-Encoding``: gzip or deflate, the one with the
    higher weight (gzip on a tie, and for ``*``); ``None`` when neither is accepted."""
    if not header:
        return None
    weights: dict[str, float] = {}
    for item in header.lower().split(",")[:16]:
        coding, _, rest = item.partition(";")
        weight = 1.0
        name, _, value = rest.strip().partition("=")
        if name.strip() == "q":
            try:
                weight = float(value)
            except ValueError:
                weight = 0.0
        weights[coding.strip()] = weight
    best: tuple[float, str] | None = None
    for coding in ENCODINGS:
        weight = weights.get(coding, weights.get("*", 0.0))
        if weight > 0 and (best is None or weight > best[0]):
            best = (weight, coding)
    return None if best is None else best[1]


def compress(body: bytes, encoding: str) -> bytes:
    """``body`` in ``encoding`` (gzip or zlib-format deflate), at zlib's fastest level: an
    answer is compressed once per call, on the serving path."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, _WBITS[encoding])
    return compressor.compress(body) + compressor.flush()
