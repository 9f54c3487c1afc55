"""A V2 call served by two processes: the request a front process decoded, for the engine
process to serve without decoding it again, and the answer the engine leaves for the front to
encode (``nograd.front``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
