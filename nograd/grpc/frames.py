"""HTTP/2's wire pieces as gRPC uses them (RFC 9113, RFC 7541): frame types, flags, settings and
error codes, a frame's bytes, header literals, and HPACK decoding."""

from __future__ import annotations

import struct
from typing import Final

import hpack

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

SETTINGS_HEADER_TABLE_SIZE: Final = 0x1
SETTINGS_MAX_CONCURRENT_STREAMS: Final = 0x3
SETTINGS_INITIAL_WINDOW_SIZE: Final = 0x4
SETTINGS_MAX_FRAME_SIZE: Final = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE: Final = 0x6

NO_ERROR: Final = 0x0
PROTOCOL_ERROR: Final = 0x1
FLOW_CONTROL_ERROR: Final = 0x3
STREAM_CLOSED: Final = 0x5
FRAME_SIZE_ERROR: Final = 0x6
REFUSED_STREAM: Final = 0x7
CANCEL: Final = 0x8
COMPRESSION_ERROR: Final = 0x9
ENHANCE_YOUR_CALM: Final = 0xB

DEFAULT_WINDOW: Final = 65_535
MAX_WINDOW: Final = 2**31 - 1
DEFAULT_FRAME_SIZE: Final = 16_384
RECEIVE_FRAME_SIZE: Final = 1 << 20
"""Largest frame this server accepts (and announces): large tensors arrive in fewer frames."""
RECEIVE_WINDOW: Final = 1 << 30
"""Bytes a peer may send ahead, per stream and per connection: message sizes are bounded by the
gRPC layer, so flow control is not what limits a call."""
MAX_HEADER_BLOCK: Final = 64 * 1024
"""Largest header block (with its CONTINUATION frames) accepted before the connection ends."""

FRAME_HEADER = struct.Struct(">HBBBL")
"""Length as 16 + 8 bits, type, flags, stream id (with its reserved bit)."""
SETTING = struct.Struct(">HL")


class ProtocolFailure(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY and this error code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return FRAME_HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's integer encoding (RFC 7541, 5.1) with ``first``'s high bits kept."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header as a literal without indexing, new name, no Huffman: the decoder's table never
    changes, so the same bytes mean the same header on every connection."""
    return b"\x00" + _integer(len(name), 7) + name + _integer(len(value), 7) + value


STATUS_200: Final = b"\x88"
"""``:status: 200``, entry 8 of HPACK's static table."""


class HeaderDecoder:
    """HPACK decoding with the answer of a block that only refers to table entries cached: such
    a block leaves the table as it was, and clients send the same block for every call."""

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._cache: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        cached = self._cache.get(block)
        if cached is not None:
            return cached
        try:
            headers = self._decoder.decode(block, raw=False)
        except hpack.HPACKError as exc:
            raise ProtocolFailure(COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        pairs = [(str(name), str(value)) for name, value in headers]
        if all(byte & 0x80 for byte in _field_starts(block)):
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[block] = pairs
        else:
            self._cache.clear()  # the table changed: cached indices may mean other headers now
        return pairs

    def set_max_table_size(self, size: int) -> None:
        del size  # the peer's decoder limit; this server's headers never index


def _field_starts(block: bytes) -> list[int]:
    """The first byte of each field of a block made only of indexed fields (RFC 7541, 6.1); a
    byte without the high bit where another kind of field starts."""
    starts = []
    index = 0
    size = len(block)
    while index < size:
        first = block[index]
        starts.append(first)
        if not first & 0x80:
            return starts
        index += 1
        if first & 0x7F == 0x7F:  # a multi-byte index
            while index < size and block[index] & 0x80:
                index += 1
            index += 1
    return starts


def unpad(payload: bytes) -> bytes:
    if not payload:
        raise ProtocolFailure(PROTOCOL_ERROR, "padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolFailure(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]
