"""Open Inference Protocol datatypes and their numpy equivalents, shared by the API and runtime."""

from __future__ import annotations

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

NUMPY_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
DATATYPES: Final = tuple(NUMPY_DTYPES)
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
