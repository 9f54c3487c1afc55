"""Open Inference Protocol datatypes in one table: numpy, torch, Triton, gRPC and ONNX names.

The ``Datatype`` literal lists the same names for type checkers and schemas (checked below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

import numpy as np

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]


@dataclass(frozen=True)
class DatatypeRow:
    """One datatype, everywhere nograd meets it: a codec, validation, a model configuration or an
    engine derives its own table from these rows, so a new datatype is one row."""

    name: str
    """The Open Inference Protocol's name (``datatype`` of a tensor)."""
    numpy: np.dtype[np.generic]
    torch: str | None
    """The ``torch`` dtype's attribute name (this module imports no torch); None: not a tensor."""
    triton: str
    """Triton's model configuration ``DataType`` (``TYPE_...``)."""
    byte_size: int
    """Bytes per element; 0 for BYTES, whose elements have their own lengths."""
    grpc_contents: str | None
    """The typed field of gRPC's ``InferTensorContents``; None: raw contents only."""
    onnx: str | None
    """ONNX Runtime's type name of a tensor of it; None: no engine input or output of it."""


def _row(
    name: str, numpy: type, torch: str | None, contents: str | None, onnx: str | None
) -> DatatypeRow:
    dtype = np.dtype(numpy)
    size = 0 if dtype.kind == "O" else dtype.itemsize
    triton = "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"
    return DatatypeRow(name, dtype, torch, triton, size, contents, onnx)


TABLE: Final[tuple[DatatypeRow, ...]] = (
    _row("BOOL", np.bool_, "bool", "bool_contents", "tensor(bool)"),
    _row("UINT8", np.uint8, "uint8", "uint_contents", "tensor(uint8)"),
    _row("UINT16", np.uint16, "uint16", "uint_contents", "tensor(uint16)"),
    _row("UINT32", np.uint32, "uint32", "uint_contents", "tensor(uint32)"),
    _row("UINT64", np.uint64, "uint64", "uint64_contents", "tensor(uint64)"),
    _row("INT8", np.int8, "int8", "int_contents", "tensor(int8)"),
    _row("INT16", np.int16, "int16", "int_contents", "tensor(int16)"),
    _row("INT32", np.int32, "int32", "int_contents", "tensor(int32)"),
    _row("INT64", np.int64, "int64", "int64_contents", "tensor(int64)"),
    _row("FP16", np.float16, "float16", None, "tensor(float16)"),
    _row("FP32", np.float32, "float32", "fp32_contents", "tensor(float)"),
    _row("FP64", np.float64, "float64", "fp64_contents", "tensor(double)"),
    _row("BYTES", np.object_, None, "bytes_contents", None),
)
ROWS: Final[dict[str, DatatypeRow]] = {row.name: row for row in TABLE}
NUMPY_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {row.name: row.numpy for row in TABLE}
DATATYPES: Final = tuple(ROWS)
assert set(DATATYPES) == set(get_args(Datatype))

_BY_DTYPE: Final[dict[np.dtype[np.generic], str]] = {
    dtype: name for name, dtype in NUMPY_DTYPES.items() if name != "BYTES"
}


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype of a numpy array (object and string arrays are BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _BY_DTYPE[array.dtype]
    except KeyError as exc:
        raise ValueError(f"numpy dtype {array.dtype} has no protocol datatype") from exc


def shape_matches(declared: tuple[int, ...], actual: tuple[int, ...]) -> bool:
    """Per-sample shape check; -1 in ``declared`` accepts any size."""
    return len(declared) == len(actual) and all(
        d == -1 or d == a for d, a in zip(declared, actual, strict=True)
    )
