"""A V2 call served by two processes: the request a front process decoded, for the engine
process to serve without decoding it again, and the answer the engine leaves for the front to
encode (``nograd.front``).

Each crosses as plain values (``to_wire``, ``from_wire``): tuples, dicts, text and bytes, each
array as its dtype, shape and bytes. Pickling numpy arrays and dataclasses looks up their
classes by module on every call, several times the cost of the values themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from nograd.protocol import shared_memory as shm
from nograd.protocol.v2 import InferRequest, RequestedOutput, dumps, encode_outputs


@dataclass(frozen=True)
class Predecoded:
    """A request decoded by the front process that read it, for the engine process to serve
    without decoding it again: what the serving core checks before decoding (the JSON's decoded
    size, the inputs it declares, its parameters) and the decoded request."""

    request: InferRequest
    declared: dict[str, tuple[str, tuple[int, ...]]]
    parameters: Any
    """The document's ``parameters`` as sent (a request deadline may be among them)."""
    json_bytes: int
    """What decoding the JSON took (``nograd.protocol.limits.json_decoded_bytes``)."""

    def to_wire(self) -> Wire:
        request = self.request
        return (
            request.id,
            {name: array_wire(array) for name, array in request.inputs.items()},
            tuple(_output_wire(output) for output in request.outputs),
            dict(request.parameters),
            self.declared,
            self.parameters,
            self.json_bytes,
        )

    @classmethod
    def from_wire(cls, wire: Wire) -> Predecoded:
        given_id, inputs, outputs, request_parameters, declared, parameters, json_bytes = wire
        request = InferRequest(
            given_id,
            {name: array_of(array) for name, array in inputs.items()},
            tuple(RequestedOutput(*output) for output in outputs),
            request_parameters,
        )
        return cls(request, declared, parameters, json_bytes)


@dataclass(frozen=True)
class Answer:
    """A model's answer to one request, its outputs selected (and classified) but not encoded:
    the engine process hands it to the front that holds the client's connection."""

    model_name: str
    model_version: str
    outputs: Mapping[str, np.ndarray]
    selected: tuple[RequestedOutput, ...]
    id: str | None
    parameters: Mapping[str, Any] | None = None
    """The response's ``parameters``, when the model answers with some (an ensemble's)."""

    def to_wire(self) -> Wire:
        return (
            self.model_name,
            self.model_version,
            {name: array_wire(array) for name, array in self.outputs.items()},
            tuple(_output_wire(output) for output in self.selected),
            self.id,
            None if self.parameters is None else dict(self.parameters),
        )

    @classmethod
    def from_wire(cls, wire: Wire) -> Answer:
        name, version, outputs, selected, given_id, parameters = wire
        arrays = {output: array_of(array) for output, array in outputs.items()}
        requested = tuple(RequestedOutput(*output) for output in selected)
        return cls(name, version, arrays, requested, given_id, parameters)


Wire = tuple[Any, ...]
OBJECTS: Final = "O"


def array_wire(array: np.ndarray) -> Wire:
    """An array as its dtype, shape and data: bytes, or a BYTES tensor's items."""
    if array.dtype.hasobject:
        return (OBJECTS, array.shape, array.reshape(-1).tolist())
    return (array.dtype.str, array.shape, array.tobytes())


def array_of(wire: Wire) -> np.ndarray:
    """The array of ``array_wire``, writable (torch refuses read-only memory)."""
    dtype, shape, data = wire
    if dtype == OBJECTS:
        items = np.empty(len(data), dtype=np.object_)
        items[:] = data
        return items.reshape(shape)
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _output_wire(output: RequestedOutput) -> Wire:
    if output.placement is not None:
        raise ValueError(f"output {output.name!r} is placed in shared memory: not handed over")
    return (output.name, output.binary, output.classification)


def encode_answer(
    answer: Answer, regions: shm.Regions | None = None
) -> tuple[bytes, list[bytes | memoryview]]:
    """The response document of ``answer`` as JSON, and its binary outputs' bytes."""
    tensors, chunks = encode_outputs(
        answer.outputs, answer.selected, model=answer.model_name, regions=regions
    )
    document: dict[str, Any] = {
        "model_name": answer.model_name,
        "model_version": answer.model_version,
        "outputs": tensors,
    }
    if answer.parameters is not None:
        document["parameters"] = answer.parameters
    if answer.id is not None:
        document["id"] = answer.id
    return dumps(document), chunks
