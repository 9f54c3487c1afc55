"""Tensors of the gRPC ModelInfer messages to and from numpy.

An input comes either in ``raw_input_contents`` (the same little-endian layout as the binary tensor
extension over HTTP, so ``nograd.protocol.binary`` decodes it) or in the typed ``contents`` field
the datatype selects; FP16 has no typed field and travels raw only. Outputs always go
back raw, as Triton answers, which costs one copy instead of a per-element conversion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from nograd.core.datatypes import NUMPY_DTYPES, TABLE, datatype_of
from nograd.core.errors import DecodeError
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.protocol import binary

CONTENTS_FIELD: Final[dict[str, str]] = {
    row.name: row.grpc_contents for row in TABLE if row.grpc_contents is not None
}
"""The typed field of ``InferTensorContents`` each datatype travels in (FP16, BF16: raw only)."""


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in raw)
    if any(d < 0 for d in shape):
        raise DecodeError(f"{where}: shape {list(shape)} has a negative dimension")
    return shape


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """The request's inputs by name; a clear ``DecodeError`` naming the input when malformed."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise DecodeError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs; "
            "send every input raw, or none"
        )
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        where = f"input {tensor.name!r}"
        if tensor.name in inputs:
            raise DecodeError(f"{where} appears twice")
        if tensor.datatype not in NUMPY_DTYPES:
            raise DecodeError(f"{where}: unknown datatype {tensor.datatype!r}")
        shape = _shape(tensor.shape, where)
        if raw:
            try:
                inputs[tensor.name] = binary.decode_tensor(
                    raw[index], tensor.datatype, shape, where
                )
            except binary.BinaryFormatError as exc:
                raise DecodeError(str(exc)) from exc
            continue
        inputs[tensor.name] = _from_contents(tensor, shape, where)
    return inputs


def _from_contents(
    tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...], where: str
) -> np.ndarray:
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise DecodeError(f"{where}: {tensor.datatype} travels only in raw_input_contents")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise DecodeError(
            f"{where}: shape {list(shape)} needs {count} values, contents.{field} holds "
            f"{len(values)}"
        )
    if tensor.datatype == "BYTES":
        return np.array(list(values), dtype=np.object_).reshape(shape)
    dtype = NUMPY_DTYPES[tensor.datatype]
    array = np.array(values, dtype=np.int64 if dtype.kind in "iu" else dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype.type)  # type: ignore[type-var]
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise DecodeError(f"{where}: a value is out of range for {tensor.datatype}")
        array = array.astype(dtype)
    return array.reshape(shape)


def encode_outputs(
    response: pb.ModelInferResponse,
    outputs: Mapping[str, np.ndarray],
    requested: list[str],
) -> None:
    """Append ``requested`` outputs (every output when empty) to ``response``, raw."""
    names = requested or list(outputs)
    unknown = sorted(set(names) - set(outputs))
    if unknown:
        raise DecodeError(f"requested output(s) {unknown} unknown; the model has {sorted(outputs)}")
    for name in names:
        array = outputs[name]
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype_of(array)
        tensor.shape.extend(int(d) for d in array.shape)
        response.raw_output_contents.append(bytes(binary.encode_tensor(array)))
