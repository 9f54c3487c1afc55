"""How a model turns decoded inputs into a forward and back: the torch side of a batch.

``ModelHandler`` is the default for plain tensor models; a model folder may subclass it (for
example to tokenise text in ``prepare``) by exposing ``build_handler`` in its module.
``TorchRunner`` adapts a handler to the batcher's ``Runner`` protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

import numpy as np
import torch

from app.datatypes import NUMPY_DTYPES
from app.runtime.config import ModelConfig, TensorSpec
from app.runtime.memory import is_out_of_memory

Outputs = dict[str, np.ndarray]

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
PRECISION_DTYPES: Final[dict[str, torch.dtype]] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, eq=False)
class TensorPart:
    """``rows`` samples ready for collation; ``length`` is the padded-cost length (1 if fixed)."""

    tensors: Mapping[str, np.ndarray]
    rows: int
    length: int = 1

    def slice(self, start: int, stop: int) -> TensorPart:
        return TensorPart(
            {name: array[start:stop] for name, array in self.tensors.items()},
            stop - start,
            self.length,
        )


class ModelHandler:
    """Default handler: each declared input goes to ``forward`` as a keyword tensor."""

    prepare_offload: ClassVar[bool] = False
    """True when ``prepare`` is heavy (tokenising, decoding): the data plane runs it in a thread."""

    def __init__(self, module: torch.nn.Module, config: ModelConfig, device: torch.device) -> None:
        self.module = module
        self.config = config
        self.device = device
        self.compute_dtype = PRECISION_DTYPES[config.precision]
        self._inputs: dict[str, TensorSpec] = {spec.name: spec for spec in config.inputs}
        self._outputs: tuple[TensorSpec, ...] = config.outputs

    # ----------------------------------------------------------------- request path (any thread)
    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Model-specific conversion of validated inputs; runs before queueing, off the device."""
        rows = len(next(iter(inputs.values())))
        return TensorPart(dict(inputs), rows, self._length_of(inputs))

    def _length_of(self, inputs: Mapping[str, np.ndarray]) -> int:
        for name, spec in self._inputs.items():
            for axis, dim in enumerate(spec.shape):
                if dim == -1:
                    return int(inputs[name].shape[axis + 1])
        return 1

    def example(self, rows: int, length: int = 1) -> TensorPart:
        """Synthetic inputs for warmup and memory profiling; variable dimensions get ``length``."""
        generator = np.random.default_rng(0)
        tensors: dict[str, np.ndarray] = {}
        for spec in self.config.inputs:
            shape = (rows, *(length if d == -1 else d for d in spec.shape))
            tensors[spec.name] = _random_array(generator, spec.datatype, shape)
        return self.prepare(tensors)

    # ----------------------------------------------------------------- device thread
    def collate(self, parts: Sequence[TensorPart]) -> dict[str, torch.Tensor]:
        """Concatenate parts along the batch dimension, padding variable dimensions with zeros."""
        batch: dict[str, torch.Tensor] = {}
        for name in parts[0].tensors:
            arrays = [part.tensors[name] for part in parts]
            tensor = _pad_concat(arrays, pin_memory=self.device.type == "cuda")
            if tensor.is_floating_point():
                tensor = tensor.to(self.compute_dtype)
            batch[name] = tensor.to(self.device, non_blocking=self.device.type == "cuda")
        return batch

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        result = self.module(**batch)
        return self._name_outputs(result)

    def _name_outputs(self, result: object) -> dict[str, torch.Tensor]:
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, Mapping):
            missing = [s.name for s in self._outputs if s.name not in result]
            if missing:
                raise RuntimeError(f"model returned no output named {missing}")
            return {s.name: result[s.name] for s in self._outputs}
        if isinstance(result, (tuple, list)) and len(result) == len(self._outputs):
            return {s.name: t for s, t in zip(self._outputs, result, strict=True)}
        raise RuntimeError(
            f"model returned {type(result).__name__}; expected a tensor, a tuple of "
            f"{len(self._outputs)} tensors or a dict keyed by output name"
        )

    def to_numpy(self, outputs: Mapping[str, torch.Tensor]) -> Outputs:
        """Outputs on the host, in each output's declared datatype."""
        arrays: Outputs = {}
        for spec in self._outputs:
            tensor = outputs[spec.name].detach()
            if spec.datatype in TORCH_DTYPES:
                tensor = tensor.to(TORCH_DTYPES[spec.datatype])
            arrays[spec.name] = tensor.cpu().numpy()
        return arrays


class TorchRunner:
    """The batcher's ``Runner`` for torch: collate, forward under inference_mode, fan out."""

    def __init__(self, handler: ModelHandler) -> None:
        self.handler = handler
        self.device = handler.device

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        with torch.inference_mode():
            batch = self.handler.collate(parts)
            outputs = self.handler.to_numpy(self.handler.forward(batch))
        return split_rows(outputs, [part.rows for part in parts])

    def concat(self, results: Sequence[Outputs]) -> Outputs:
        return {name: np.concatenate([r[name] for r in results]) for name in results[0]}

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return is_out_of_memory(exc)

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def split_rows(outputs: Outputs, rows: Sequence[int]) -> list[Outputs]:
    """Each part's rows of every output, in order; a row-count mismatch is a model bug."""
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise RuntimeError(
                f"output {name!r} has {array.shape[0] if array.ndim else 0} rows for a batch "
                f"of {total}"
            )
    results: list[Outputs] = []
    start = 0
    for count in rows:
        results.append({name: array[start : start + count] for name, array in outputs.items()})
        start += count
    return results


def _pad_concat(arrays: Sequence[np.ndarray], pin_memory: bool = False) -> torch.Tensor:
    """One host tensor holding every part's rows, zero-padded along variable dimensions.

    A single part is used in place (no copy). Several parts are copied once into one torch
    allocation, which the memory profiler sees, and which is pinned when bound for a GPU so the
    host-to-device copy can run asynchronously.
    """
    if len(arrays) == 1 and not pin_memory:
        return torch.from_numpy(np.ascontiguousarray(arrays[0]))
    target = tuple(max(a.shape[axis] for a in arrays) for axis in range(arrays[0].ndim))
    rows = sum(a.shape[0] for a in arrays)
    dtype = torch.from_numpy(arrays[0][:0]).dtype
    ragged = any(a.shape[1:] != target[1:] for a in arrays)
    make = torch.zeros if ragged else torch.empty
    out = make((rows, *target[1:]), dtype=dtype, pin_memory=pin_memory)
    start = 0
    for array in arrays:
        region = out[start : start + array.shape[0]]
        for axis, size in enumerate(array.shape[1:], start=1):
            region = region.narrow(axis, 0, size)
        region.copy_(torch.from_numpy(array))
        start += array.shape[0]
    return out


def _random_array(
    generator: np.random.Generator, datatype: str, shape: tuple[int, ...]
) -> np.ndarray:
    if datatype == "BOOL":
        return generator.integers(0, 2, size=shape).astype(np.bool_)
    if datatype.startswith(("INT", "UINT")):
        return generator.integers(0, 2, size=shape).astype(NUMPY_DTYPES[datatype])
    if datatype == "BYTES":
        return np.full(shape, b"warmup", dtype=np.object_)
    return generator.random(size=shape).astype(NUMPY_DTYPES[datatype])
