"""The gRPC wire around ``nograd.grpc.h2``'s streams: status codes and the trailers that carry
them, the 5-byte message prefix, ``grpc-timeout``, compressed messages, and the context a
servicer ends its call through."""

from __future__ import annotations

import enum
import logging
import re
import time
import zlib
from collections.abc import Sequence
from typing import Final
from urllib.parse import quote

from google.protobuf.message import Message

from nograd.grpc.frames import STATUS_200, literal

logger = logging.getLogger(__name__)


class Code(enum.IntEnum):
    """gRPC status codes (grpc/doc/statuscodes.md)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


RESPONSE_HEADERS: Final = STATUS_200 + literal(b"content-type", b"application/grpc")
PREFIX_BYTES: Final = 5
"""Each message's prefix: a compressed flag and a 4-byte big-endian length."""
_TIMEOUT_UNITS: Final = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_TIMEOUT: Final = re.compile(r"([0-9]{1,8})([HMSmun])")
"""gRPC's TimeoutValue and TimeoutUnit: 1 to 8 ASCII digits, no sign, then the unit."""
_MESSAGE_SAFE: Final = " !#$&'()*+,/:;=?@[]~"
"""Printable ASCII left as is in ``grpc-message``; the rest is percent-encoded (gRPC's spec)."""


class Abort(Exception):
    """A call ended with a status other than OK (raised by ``CallContext.abort``)."""

    def __init__(self, code: Code, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class CallContext:
    """What a servicer learns of its call and how it ends it with a status."""

    __slots__ = ("_deadline", "_metadata", "trailing_metadata")

    def __init__(self, metadata: list[tuple[str, str]], deadline: float | None) -> None:
        self._metadata = metadata
        self._deadline = deadline
        self.trailing_metadata: Sequence[tuple[str, str]] = ()

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline (``grpc-timeout``); None without one."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing_metadata = metadata

    async def abort(self, code: Code, details: str) -> None:
        raise Abort(code, details)


def trailers(code: Code, message: str = "", extra: Sequence[tuple[str, str]] = ()) -> bytes:
    """The header block that ends a call: its status, message and trailing metadata."""
    block = literal(b"grpc-status", str(int(code)).encode())
    if message:
        block += literal(b"grpc-message", quote(message, safe=_MESSAGE_SAFE).encode())
    for name, value in extra:
        block += literal(name.encode("latin-1"), value.encode("latin-1"))
    return block


def message_bytes(response: Message) -> bytes:
    payload: bytes = response.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def parse_timeout(value: str) -> float | None:
    """``grpc-timeout`` (at most 8 ASCII digits and a unit) in seconds; None when malformed
    (a sign, another digit than 0-9, no unit), which the call is refused for."""
    matched = _TIMEOUT.fullmatch(value)
    if matched is None:
        return None
    return int(matched[1]) * _TIMEOUT_UNITS[matched[2]]


def decompress(payload: bytes, encoding: str, limit: int) -> bytes:
    if encoding not in ("gzip", "deflate"):
        raise Abort(Code.INTERNAL, f"a compressed message with grpc-encoding {encoding!r}")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(payload, limit + 1)
    except zlib.error as exc:
        logger.debug("undecompressable %s request: %s", encoding, exc)
        raise Abort(Code.INTERNAL, f"cannot decompress the request: not {encoding} data") from exc
    if len(out) > limit:
        raise Abort(Code.RESOURCE_EXHAUSTED, f"decompressed message larger than max ({limit})")
    return out
