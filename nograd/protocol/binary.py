"""The binary tensor data extension of the Open Inference Protocol, as Triton defines it.

A request or response body is a JSON header followed by raw tensor bytes; the HTTP header
``Inference-Header-Content-Length`` gives the JSON's length. A tensor carried in the binary part
has ``"parameters": {"binary_data_size": <bytes>}`` instead of ``data``, and the binary tensors
follow the JSON in the order they appear in it. Tensors are row-major and little-endian, with no
padding; BOOL is one byte (0 or 1); each BYTES element is a 4-byte little-endian length followed
by that many bytes.

Pure codec, numpy only: fixed-size tensors are decoded with ``np.frombuffer`` (a view, no copy)
and encoded from a view of the array when it is already contiguous little-endian. Errors are
:class:`BinaryFormatError` with a message naming the tensor and the sizes involved.
"""

from __future__ import annotations

import math
import struct
from typing import Final

import numpy as np

from nograd.core.datatypes import NUMPY_DTYPES

HEADER_LENGTH: Final = "Inference-Header-Content-Length"
CONTENT_TYPE: Final = "application/octet-stream"
SIZE_PARAMETER: Final = "binary_data_size"
_LENGTH_PREFIX: Final = struct.Struct("<I")


class BinaryFormatError(ValueError):
    """Binary data that does not match its header; the message says which tensor and why."""


def little_endian(datatype: str) -> np.dtype[np.generic]:
    """The wire dtype of a fixed-size datatype (BOOL travels as one byte per element)."""
    dtype = NUMPY_DTYPES[datatype]
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def split_body(body: bytes | bytearray, header_length: str | None) -> tuple[memoryview, memoryview]:
    """The JSON header and the binary part of a body; without the header, all of it is JSON."""
    view = memoryview(body)
    if header_length is None:
        return view, view[len(view) :]
    text = header_length.strip()
    if not text.isdigit():
        raise BinaryFormatError(
            f"header {HEADER_LENGTH} must be a non-negative integer, got {header_length!r}"
        )
    length = int(text)
    if length > len(view):
        raise BinaryFormatError(
            f"header {HEADER_LENGTH} is {length} but the body has only {len(view)} bytes"
        )
    return view[:length], view[length:]


class BinaryReader:
    """Hands out consecutive tensors from the binary part of a request body."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._offset = 0

    def take(self, size: object, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
        """The next ``size`` bytes as a tensor of ``datatype`` and ``shape``."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BinaryFormatError(
                f"{where}: parameter {SIZE_PARAMETER} must be a non-negative integer, got {size!r}"
            )
        available = len(self._data) - self._offset
        if size > available:
            raise BinaryFormatError(
                f"{where}: {SIZE_PARAMETER} is {size} but only {available} bytes of binary "
                f"data remain"
            )
        chunk = self._data[self._offset : self._offset + size]
        self._offset += size
        return decode_tensor(chunk, datatype, shape, where)

    def finish(self) -> None:
        """Every byte must belong to a tensor: leftovers mean the sizes were wrong."""
        left = len(self._data) - self._offset
        if left:
            raise BinaryFormatError(
                f"{left} bytes of binary data follow the last binary input; check "
                f"{SIZE_PARAMETER} and {HEADER_LENGTH}"
            )


def check_size(size: int, datatype: str, shape: tuple[int, ...], where: str) -> int:
    """The element count of ``shape`` once ``size`` raw bytes can hold it: exactly its bytes for a
    fixed-size datatype, at least a 4-byte length prefix per element for BYTES. Python ints, so a
    hostile shape cannot overflow the count; checked before any array is allocated."""
    count = math.prod(shape)
    if datatype == "BYTES":
        if count * _LENGTH_PREFIX.size > size:
            raise BinaryFormatError(
                f"{where}: {count} BYTES elements need at least {count * _LENGTH_PREFIX.size} "
                f"bytes, {SIZE_PARAMETER} is {size}"
            )
        return count
    expected = count * NUMPY_DTYPES[datatype].itemsize
    if size != expected:
        raise BinaryFormatError(
            f"{where}: shape {list(shape)} of {datatype} needs {expected} bytes, "
            f"{SIZE_PARAMETER} is {size}"
        )
    return count


def decode_tensor(
    data: memoryview | bytes, datatype: str, shape: tuple[int, ...], where: str
) -> np.ndarray:
    """One tensor from its raw bytes; fixed-size datatypes become a view of ``data``."""
    count = check_size(len(data), datatype, shape, where)
    if datatype == "BYTES":
        return _decode_bytes(memoryview(data), count, where).reshape(shape)
    dtype = little_endian(datatype)
    if datatype == "BOOL":
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size and raw.max() > 1:
            raise BinaryFormatError(f"{where}: BOOL bytes must be 0 or 1")
        return raw.view(np.bool_).reshape(shape)
    array = np.frombuffer(data, dtype=dtype)
    if not dtype.isnative:  # big-endian hosts only: one byte-swapping copy
        array = array.astype(dtype.newbyteorder("="))
    return array.reshape(shape)


def _decode_bytes(data: memoryview, count: int, where: str) -> np.ndarray:
    """``count`` elements, no more: the loop is bounded by the count the shape declares (checked
    against its limits and the data's length first), however many the data holds."""
    total = len(data)
    out = np.empty(count, dtype=np.object_)
    unpack = _LENGTH_PREFIX.unpack_from  # bound once: this loop runs once per element
    offset = 0
    for index in range(count):
        start = offset + 4
        if start > total:
            raise BinaryFormatError(
                f"{where}: BYTES data ends after {index} of {count} elements "
                f"(no length prefix at byte {offset})"
            )
        (length,) = unpack(data, offset)
        offset = start + length
        if offset > total:
            raise BinaryFormatError(
                f"{where}: BYTES element {index} claims {length} bytes, only {total - start} remain"
            )
        out[index] = data[start:offset].tobytes()
    if offset != total:
        raise BinaryFormatError(
            f"{where}: {total - offset} bytes left after the {count} BYTES elements the shape needs"
        )
    return out


def encode_tensor(array: np.ndarray) -> bytes | memoryview:
    """Raw bytes of a tensor, row-major little-endian (a view when no conversion is needed)."""
    if array.dtype.kind in ("O", "S", "U"):
        return _encode_bytes(array)
    wire = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
    contiguous = np.ascontiguousarray(array, dtype=wire).reshape(-1)
    return contiguous.view(np.uint8).data


def _encode_bytes(array: np.ndarray) -> bytes:
    pieces: list[bytes] = []
    for value in array.reshape(-1):
        item = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        pieces.append(_LENGTH_PREFIX.pack(len(item)))
        pieces.append(item)
    return b"".join(pieces)


def join_body(header: bytes, chunks: list[bytes | memoryview]) -> bytes:
    """A response body: the JSON header then each binary output, in the header's order."""
    return b"".join([header, *chunks])
