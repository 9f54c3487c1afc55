"""Tensors of the gRPC ModelInfer messages to and from numpy.

An input comes either in ``raw_input_contents`` (the same little-endian layout as the binary tensor
extension over HTTP, so ``nograd.protocol.binary`` decodes it) or in the typed ``contents`` field
the datatype selects; FP16 has no typed field and travels raw only. Outputs always go
back raw, as Triton answers, which costs one copy instead of a per-element conversion.

Every input is checked before any array is built, in the order that costs least: its shape
(``nograd.protocol.limits``), then what the model declares (the serving core's check, the same one
HTTP's requests pass: rows within ``NOGRAD_MAX_REQUEST_ROWS`` of the declared per-sample shape),
then the contents' length against the element count. Only then are values read, off the event
loop when there are many of them, so a hostile message is refused for the cost of its header.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from nograd.core.datatypes import NUMPY_DTYPES, ROWS, TABLE, datatype_of
from nograd.core.errors import DecodeError
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.protocol import binary, classification
from nograd.protocol import shared_memory as shm
from nograd.protocol.limits import OFFLOAD_DECODE_BYTES, checked_shape
from nograd.serving.calls.validation import Declared
from nograd.serving.extensions.sequences import SEQUENCE_PARAMETERS

CONTENTS_FIELD: Final[dict[str, str]] = {
    row.name: row.grpc_contents for row in TABLE if row.grpc_contents is not None
}
"""The typed field of ``InferTensorContents`` each datatype travels in (FP16, BF16: raw only)."""
_FIELD_DTYPE: Final[dict[str, np.dtype[np.generic]]] = {
    field: max(
        (ROWS[name].numpy for name, f in CONTENTS_FIELD.items() if f == field),
        key=lambda dtype: dtype.itemsize,
    )
    for field in set(CONTENTS_FIELD.values())
}
"""What a typed field holds on the wire: the widest datatype sent in it (``uint_contents`` is
uint32 for UINT8 to UINT32), so its values convert exactly before their range is checked."""

Check = Callable[[Declared], None]
"""The serving core's check of the declared inputs against the model (it raises to refuse)."""
Parameters = Mapping[str, pb.InferParameter]


def plain(parameters: Parameters) -> dict[str, Any]:
    """A message's parameters as plain values (each ``InferParameter``'s one set field)."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, kind) if kind else None
    return values


def placements(tensors: Any, side: str) -> list[shm.Placement | None]:
    """Each tensor's place in shared memory (its ``shared_memory_*`` parameters), or None."""
    return [shm.placement(plain(t.parameters), f"{side} {t.name!r}") for t in tensors]


def check_inputs(request: pb.ModelInferRequest, check: Check | None = None) -> Declared:
    """Every input's header, checked without reading any value: names, datatypes, shapes,
    ``check`` (the model's declared inputs and limits), then each tensor's contents holding
    exactly what its shape needs. A ``DecodeError`` (or ``check``'s refusal) names the input."""
    tensors = list(request.inputs)
    raw = request.raw_input_contents
    places = placements(tensors, "input")
    for tensor, place in zip(tensors, places, strict=True):
        # Triton's refusals of contents sent twice, word for word, input by input, before any
        # other check of the contents (its explicit-content example clients check for them).
        if not tensor.HasField("contents"):
            continue
        if place is not None:
            raise DecodeError(
                "unexpected 'content' provided when using shared memory for input tensor "
                f"'{tensor.name}' for model '{request.model_name}'"
            )
        if raw:
            raise DecodeError(
                "contents field must not be specified when using raw_input_contents for "
                f"'{tensor.name}' for model '{request.model_name}'"
            )
    carried = sum(place is None for place in places)
    if raw and len(raw) != carried:
        raise DecodeError(
            f"raw_input_contents holds {len(raw)} tensors for {carried} inputs not in shared "
            "memory; send every such input raw, or none"
        )
    declared: dict[str, tuple[str, tuple[int, ...]]] = {}
    wheres: list[str] = []
    for tensor in tensors:
        name, datatype = tensor.name, tensor.datatype  # each read of a field builds a str
        where = f"input {name!r}"
        if name in declared:
            raise DecodeError(f"{where} appears twice")
        if datatype not in NUMPY_DTYPES:
            raise DecodeError(f"{where}: unknown datatype {datatype!r}")
        declared[name] = (datatype, checked_shape(tensor.shape, where))
        wheres.append(where)
    if check is not None:
        check(declared)
    index = 0
    for (datatype, shape), tensor, where, place in zip(
        declared.values(), tensors, wheres, places, strict=True
    ):
        if place is not None:
            continue
        index += 1
        if not raw:
            _check_contents(tensor, datatype, shape, where)
            continue
        try:
            binary.check_size(len(raw[index - 1]), datatype, shape, where)
        except binary.BinaryFormatError as exc:
            raise DecodeError(str(exc)) from exc
    return declared


def _check_contents(
    tensor: pb.ModelInferRequest.InferInputTensor,
    datatype: str,
    shape: tuple[int, ...],
    where: str,
) -> None:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise DecodeError(f"{where}: {datatype} travels only in raw_input_contents")
    stray = sorted(f for f in _FIELD_DTYPE if f != field and len(getattr(tensor.contents, f)))
    if stray:
        raise DecodeError(
            f"{where}: contents.{stray[0]} holds values, but {datatype} travels in contents.{field}"
        )
    count = math.prod(shape)
    values = len(getattr(tensor.contents, field))
    if values != count:
        raise DecodeError(
            f"{where}: shape {list(shape)} needs {count} values, contents.{field} holds {values}"
        )


def decode_inputs(
    request: pb.ModelInferRequest, check: Check | None = None, regions: shm.Regions | None = None
) -> dict[str, np.ndarray]:
    """The request's inputs by name, once ``check_inputs`` passed them."""
    return _arrays(request, check_inputs(request, check), regions)


async def read_inputs(
    request: pb.ModelInferRequest, check: Check, regions: shm.Regions | None = None
) -> dict[str, np.ndarray]:
    """``decode_inputs`` with its checks on the event loop (a refusal costs no thread hand-off)
    and the values read in a thread when they are large, as HTTP decodes a large body: a
    model with variable dimensions may take millions of BYTES elements, each parsed in Python,
    and a copy out of shared memory is as large as its byte size. BYTES in shared memory are
    held within the request's limits first (``Regions.hold``)."""
    declared = check_inputs(request, check)
    placed, unsized = shm.placed_bytes((t.datatype, plain(t.parameters)) for t in request.inputs)
    if unsized and regions is not None:
        regions.hold(unsized)  # BYTES in shared memory: within the request's limits, first
    if _payload_bytes(request, declared) + placed > OFFLOAD_DECODE_BYTES:
        return await asyncio.to_thread(_arrays, request, declared, regions)
    return _arrays(request, declared, regions)


def _payload_bytes(request: pb.ModelInferRequest, declared: Declared) -> int:
    """About how many bytes the tensors carried in the message hold, from lengths alone (no
    value read)."""
    raw = request.raw_input_contents
    total = 0
    if raw:
        return total + sum(len(chunk) for chunk in raw)
    for (datatype, _), tensor in zip(declared.values(), request.inputs, strict=True):
        field = CONTENTS_FIELD.get(datatype)
        if field is None:  # only in shared memory
            continue
        values = len(getattr(tensor.contents, field))
        total += values * max(ROWS[datatype].byte_size, 4)
    return total


def _arrays(
    request: pb.ModelInferRequest, declared: Declared, regions: shm.Regions | None = None
) -> dict[str, np.ndarray]:
    raw = request.raw_input_contents
    places = placements(request.inputs, "input")
    inputs: dict[str, np.ndarray] = {}
    carried = 0
    for index, (name, (datatype, shape)) in enumerate(declared.items()):
        where = f"input {name!r}"
        place = places[index]
        if place is not None:
            inputs[name] = shm.read_input(regions, place, name, datatype, shape)
        elif raw:
            carried += 1
            try:
                inputs[name] = binary.decode_tensor(raw[carried - 1], datatype, shape, where)
            except binary.BinaryFormatError as exc:
                raise DecodeError(str(exc)) from exc
        else:
            inputs[name] = _from_contents(request.inputs[index], datatype, shape, where)
    return inputs


def _from_contents(
    tensor: pb.ModelInferRequest.InferInputTensor,
    datatype: str,
    shape: tuple[int, ...],
    where: str,
) -> np.ndarray:
    field = CONTENTS_FIELD[datatype]
    values: Any = getattr(tensor.contents, field)
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=np.object_)
        array[:] = list(values)
        return array.reshape(shape)
    dtype = NUMPY_DTYPES[datatype]
    array = np.array(values, dtype=_FIELD_DTYPE[field])
    if array.size and dtype.itemsize < array.dtype.itemsize:  # narrower than its field
        info = np.iinfo(dtype.type)  # type: ignore[type-var]
        # Python ints: comparing a uint64 with a negative bound in numpy would go through float.
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            value = low if low < info.min else high
            raise DecodeError(
                f"{where}: value {value} in contents.{field} is out of range for {datatype} "
                f"({info.min} to {info.max})"
            )
        array = array.astype(dtype, copy=False)
    return array.reshape(shape)


def class_counts(request: pb.ModelInferRequest) -> dict[str, int]:
    """The outputs asked for by classification (Triton's ``classification`` parameter of a
    requested output, an int64), with their number of classes."""
    counts: dict[str, int] = {}
    for output in request.outputs:
        parameter = output.parameters.get(classification.PARAMETER)
        if parameter is None:
            continue
        kind = parameter.WhichOneof("parameter_choice")
        value = getattr(parameter, kind) if kind else None
        counts[output.name] = classification.class_count(value, output.name)
    return counts


def encode_outputs(
    response: pb.ModelInferResponse,
    outputs: Mapping[str, np.ndarray],
    requested: Any,
    regions: shm.Regions | None = None,
) -> None:
    """Append the ``requested`` outputs (``InferRequestedOutputTensor``s; every output when
    none) to ``response``, raw; one placed in shared memory is written into its region and
    answers its placement, with no contents."""
    names = [output.name for output in requested] or list(outputs)
    places = placements(requested, "output") if requested else [None] * len(names)
    unknown = sorted(set(names) - set(outputs))
    if unknown:
        raise DecodeError(f"requested output(s) {unknown} unknown; the model has {sorted(outputs)}")
    for name, place in zip(names, places, strict=True):
        array = outputs[name]
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype_of(array)
        tensor.shape.extend(int(d) for d in array.shape)
        if place is None:
            response.raw_output_contents.append(bytes(binary.encode_tensor(array)))
            continue
        shm.write_output(regions, place, name, array)
        tensor.parameters[shm.REGION].string_param = place.region
        tensor.parameters[shm.OFFSET].int64_param = place.offset
        tensor.parameters[shm.BYTE_SIZE].int64_param = place.byte_size
        response.raw_output_contents.append(b"")
    # Only an output a raw one follows needs its empty entry (clients read the list by index).
    contents = response.raw_output_contents
    while contents and not contents[-1] and places[len(contents) - 1] is not None:
        del contents[-1]


def sequence_parameters(request: Any) -> dict[str, object]:
    """A request's sequence parameters as values (an id may be a number or a string)."""
    found: dict[str, object] = {}
    for key in SEQUENCE_PARAMETERS:
        parameter = request.parameters.get(key)
        if parameter is not None:
            choice = parameter.WhichOneof("parameter_choice") or "bool_param"
            found[key] = getattr(parameter, choice)
    return found
