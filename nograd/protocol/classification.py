"""Triton's classification extension: a requested output's ``classification: N`` parameter
answers, per row, its N largest elements as BYTES ``"score:index"`` strings, ``"score:index:label"``
where the output has labels (Triton's ``label_filename``), best first. Scores are written as
Triton's server writes them (C++ ``std::to_string``: six decimals for a float, digits for an
integer). Every front applies it here, to the model's answer, so HTTP and gRPC agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from nograd.core.datatypes import datatype_of
from nograd.core.errors import DecodeError

PARAMETER: Final = "classification"
CLASSIFIABLE: Final = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}
)
"""The datatypes Triton classifies (not FP16, BF16, BOOL or BYTES)."""


def class_count(value: Any, output: str) -> int:
    """The ``classification`` parameter of ``output``: a positive number of classes."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DecodeError(
            f"output {output!r}: parameter {PARAMETER!r} must be a positive integer (the number "
            f"of classes to answer), got {value!r}"
        )
    return value


def classified(
    outputs: Mapping[str, np.ndarray],
    counts: Mapping[str, int],
    labels: Mapping[str, Sequence[str]],
    *,
    batched: bool,
) -> Mapping[str, np.ndarray]:
    """``outputs`` with each output ``counts`` names replaced by its top classes (``labels``:
    each output's class names); an output the model does not give is left to the front's own
    refusal of unknown outputs."""
    if not counts:
        return outputs
    answered = dict(outputs)
    for name, count in counts.items():
        array = outputs.get(name)
        if array is None:
            continue
        datatype = datatype_of(array)
        if datatype not in CLASSIFIABLE:
            raise DecodeError(
                f"class result not available for output due to unsupported type '{datatype}'"
            )
        answered[name] = top_classes(array, count, labels.get(name, ()), batched=batched)
    return answered


def top_classes(
    array: np.ndarray, count: int, labels: Sequence[str], *, batched: bool
) -> np.ndarray:
    """The ``count`` largest elements of each row (of the whole tensor without a batch
    dimension), as ``score:index[:label]`` bytes: shape ``[rows, k]`` (``[k]`` unbatched), ``k``
    at most the row's element count. Equal scores keep their index order."""
    rows = array.reshape(array.shape[0] if batched and array.ndim else 1, -1)
    width = rows.shape[1]
    kept = min(count, width)
    answer = np.empty((rows.shape[0], kept), dtype=np.object_)
    floating = rows.dtype.kind == "f"
    for row_index, row in enumerate(rows):
        # A stable descending order: ascending over the reversed row, read backwards.
        order = width - 1 - np.argsort(row[::-1], kind="stable")[::-1][:kept]
        for place, index in enumerate(order.tolist()):
            value = row[index]
            score = f"{float(value):f}" if floating else str(int(value))
            text = f"{score}:{index}"
            if index < len(labels):
                text += f":{labels[index]}"
            answer[row_index, place] = text.encode("utf-8")
    return answer if batched else answer.reshape(kept)
