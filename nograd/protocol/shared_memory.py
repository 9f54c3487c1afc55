"""Tensors placed in a shared-memory region (Triton's extension: a system or a CUDA region), for
every front: the ``shared_memory_region`` / ``shared_memory_offset`` / ``shared_memory_byte_size``
parameters of an input or a requested output, an input's bytes read from the region and decoded
as binary tensor data is (BYTES elements with 4-byte length prefixes), an output's bytes written
into it.

The regions themselves live in the serving core (``nograd.serving.extensions.shared_memory``); a
front hands them in as ``Regions``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np

from nograd.core.datatypes import NUMPY_DTYPES
from nograd.core.errors import DecodeError
from nograd.protocol import binary

REGION: Final = "shared_memory_region"
OFFSET: Final = "shared_memory_offset"
BYTE_SIZE: Final = "shared_memory_byte_size"


class Regions(Protocol):
    """The regions one call may use (``nograd.serving.extensions.shared_memory.CallerRegions``)."""

    def hold(self, byte_size: int) -> None:
        """Take ``byte_size`` bytes of BYTES inputs about to be copied out (no declared shape
        sizes them), or refuse: past the request's decoded-size limit, or the process's byte
        budget. Fronts call it on the event loop, before any copy (``placed_bytes``)."""

    def read(self, name: str, offset: int, byte_size: int) -> bytearray: ...

    def write(
        self, name: str, offset: int, byte_size: int, data: bytes | memoryview, what: str
    ) -> None: ...


@dataclass(frozen=True)
class Placement:
    """Where in which region a tensor lies."""

    region: str
    offset: int
    byte_size: int

    def parameters(self) -> dict[str, Any]:
        return {REGION: self.region, OFFSET: self.offset, BYTE_SIZE: self.byte_size}


def placement(parameters: Mapping[str, Any], where: str) -> Placement | None:
    """The placement ``parameters`` (plain values) give; None without ``shared_memory_region``."""
    region = parameters.get(REGION)
    if region is None:
        return None
    if not isinstance(region, str) or not region:
        raise DecodeError(f"{where}: parameter {REGION} must be a region's name")
    byte_size = parameters.get(BYTE_SIZE)
    if byte_size is None:
        raise DecodeError(f"{where}: parameter {BYTE_SIZE} must be given with {REGION}")
    offset = _whole(parameters.get(OFFSET, 0), OFFSET, where)
    return Placement(region, offset, _whole(byte_size, BYTE_SIZE, where))


def _whole(value: Any, name: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DecodeError(
            f"{where}: parameter {name} must be a non-negative integer, got {value!r}"
        )
    return value


def read_input(
    regions: Regions | None,
    place: Placement,
    name: str,
    datatype: str,
    shape: tuple[int, ...],
) -> np.ndarray:
    """An input's tensor copied out of its region: a fixed-size datatype's byte size must be
    exactly what its shape needs (checked before a byte is read), BYTES must hold its elements
    (its byte size was held by the front: ``placed_bytes``)."""
    if regions is None:
        raise DecodeError(f"input '{name}': shared memory is not served on this route")
    if datatype != "BYTES":
        expected = math.prod(shape) * NUMPY_DTYPES[datatype].itemsize
        if place.byte_size != expected:
            raise DecodeError(
                f"input byte size mismatch for input '{name}'. Expected {expected}, "
                f"got {place.byte_size}"
            )
    data = regions.read(place.region, place.offset, place.byte_size)
    try:
        return binary.decode_tensor(memoryview(data), datatype, shape, f"input '{name}'")
    except binary.BinaryFormatError as exc:
        raise DecodeError(str(exc)) from exc


def placed_bytes(tensors: Iterable[tuple[Any, Mapping[str, Any]]]) -> tuple[int, int]:
    """Bytes the tensors given as (datatype, parameters as plain values) place in shared memory:
    in all, and those of BYTES tensors, which their shapes do not size. Read from the
    parameters alone (a malformed one counts nothing: decoding refuses it), so a front holds
    them (``Regions.hold``) and moves a large copy off the event loop before a byte is read."""
    total = unsized = 0
    for datatype, parameters in tensors:
        size = parameters.get(BYTE_SIZE) if parameters.get(REGION) is not None else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            total += size
            unsized += size if datatype == "BYTES" else 0
    return total, unsized


def write_output(regions: Regions | None, place: Placement, name: str, array: np.ndarray) -> None:
    """An output's bytes written into its region, when the request's byte size holds them."""
    if regions is None:
        raise DecodeError(f"output '{name}': shared memory is not served on this route")
    regions.write(place.region, place.offset, place.byte_size, binary.encode_tensor(array), name)
