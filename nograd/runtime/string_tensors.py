"""ONNX models with string tensors (Triton's ``TYPE_STRING``, the protocol's BYTES): batched and
run on numpy arrays, never through torch, which holds no strings.

ONNX Runtime's Python API takes a string tensor as a numpy object array of ``str`` and gives one
back; requests carry ``bytes``. The handler turns each request's BYTES into ``str`` (UTF-8,
refusing what is not, before it queues), joins the requests the batcher took into one batch per
input, runs the session once and gives each request its rows, its BYTES outputs as ``bytes``: a
``RequestRunner``, no torch anywhere on the way. Strings mean what the model reads in them, so it
runs on requests (and Triton's ``model_warmup``) only: no synthetic batches, its batch limit its
config's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from nograd.core.datatypes import NUMPY_DTYPES
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.onnx import OnnxPath
from nograd.runtime.handler import Outputs, TensorPart, split_rows
from nograd.runtime.runners import RequestRunner
from nograd.schema.config import ModelConfig, TensorSpec


def has_strings(config: ModelConfig) -> bool:
    """Whether any input or output of the model is BYTES."""
    return any(spec.datatype == "BYTES" for spec in (*config.inputs, *config.outputs))


class StringTensorHandler(RequestRunner):
    """Runs an ONNX model's batches on host arrays through ``OnnxPath.run_arrays``."""

    def __init__(self, engine: OnnxPath, config: ModelConfig, device: torch.device) -> None:
        super().__init__(config, device)
        inputs = sorted(spec.name for spec in config.inputs)
        if inputs != sorted(engine.inputs):
            raise ArtifactError(
                f"the model takes inputs {sorted(engine.inputs)}, the config lists {inputs}"
            )
        missing = sorted({spec.name for spec in config.outputs} - set(engine.outputs))
        if missing:
            raise ArtifactError(f"the model gives no output named {missing}")
        self.engine = engine
        self.speed_path = engine

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """BYTES inputs as object arrays of ``str``: a request whose bytes are not UTF-8 is
        refused here, naming the input (ONNX Runtime's Python API takes text only)."""
        converted = dict(inputs)
        for spec in self.config.inputs:
            if spec.datatype == "BYTES" and spec.name in converted:
                converted[spec.name] = as_text(spec.name, converted[spec.name])
        return super().prepare(converted)

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        """The parts' rows joined into one run; each part gets its own rows back."""
        unbatched = self.config.batch_dimension is False
        if unbatched and len(parts) != 1:
            raise RuntimeError(
                f"model {self.config.name!r} has no batch dimension: one request at a time"
            )
        feeds: dict[str, np.ndarray] = {}
        for spec in self.config.inputs:
            array = _join([part.tensors[spec.name] for part in parts], spec)
            if spec.datatype == "BYTES" and array.size and isinstance(array.flat[0], bytes):
                array = as_text(spec.name, array)  # a warmup sample: never through ``prepare``
            if spec.reshape is not None:
                array = array.reshape(array.shape[0], *spec.reshape)
            feeds[spec.name] = array[0] if unbatched else array
        results = self.engine.run_arrays(feeds)
        outputs: Outputs = {}
        for spec in self.config.outputs:
            array = results[spec.name]
            if unbatched:
                array = array[np.newaxis]
            if spec.reshape is not None:
                array = array.reshape(array.shape[0], *spec.shape)
            outputs[spec.name] = _declared(array, spec)
        return split_rows(outputs, [part.rows for part in parts])


def as_text(name: str, array: np.ndarray) -> np.ndarray:
    """An object array of ``str`` from one of ``bytes`` (or ``str``)."""
    flat = array.reshape(-1)
    text = np.empty(flat.shape, dtype=np.object_)
    for index, value in enumerate(flat):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"input {name!r}: element {index} is not UTF-8 text ({exc.reason} at byte "
                    f"{exc.start}); ONNX Runtime takes string tensors as text"
                ) from exc
        text[index] = str(value)
    return text.reshape(array.shape)


def _join(arrays: Sequence[np.ndarray], spec: TensorSpec) -> np.ndarray:
    """The parts' rows in one array, variable dimensions padded (empty strings, zeros)."""
    if len(arrays) == 1:
        return arrays[0]
    shapes = {array.shape[1:] for array in arrays}
    if len(shapes) == 1:
        return np.concatenate(arrays)
    target = [max(array.shape[axis] for array in arrays) for axis in range(arrays[0].ndim)]
    target[0] = sum(array.shape[0] for array in arrays)
    filler: object = "" if spec.datatype == "BYTES" else 0
    out = np.full(target, filler, dtype=arrays[0].dtype)
    start = 0
    for array in arrays:
        region = (slice(start, start + array.shape[0]), *(slice(0, n) for n in array.shape[1:]))
        out[region] = array
        start += array.shape[0]
    return out


def _declared(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """An output in its declared datatype; strings as object arrays of UTF-8 ``bytes``, as a
    request's are."""
    if spec.datatype != "BYTES":
        return array.astype(NUMPY_DTYPES[spec.datatype], copy=False)
    flat = array.reshape(-1)
    encoded = np.empty(flat.shape, dtype=np.object_)
    for index, value in enumerate(flat):
        encoded[index] = value if isinstance(value, bytes) else str(value).encode("utf-8")
    return encoded.reshape(array.shape)
