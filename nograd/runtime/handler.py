"""How a model turns decoded inputs into a forward and back: the torch side of a batch.

``ModelHandler`` is the default for plain tensor models; a model folder may subclass it (for
example to tokenise text in ``prepare``) by exposing ``build_handler`` in its module.
``TorchRunner`` adapts a handler to the batcher's ``Runner`` protocol. A speed mode (see
``nograd/runtime/speed/``) or an engine plugs in as the handler's ``speed_path``: fixed batch
shapes to pad to and the forward to call. Models that are not torch forwards run their batches
themselves (``nograd.runtime.runners.RequestRunner``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Protocol

import numpy as np
import torch

# Imported with the server, not by its first load (nograd.serving.frozen_heap: a library a load
# imports makes the heap freeze again, with that load's model).
from numpy.random import Generator, default_rng

from nograd.core.datatypes import NUMPY_DTYPES, TABLE
from nograd.runtime.memory import is_out_of_memory
from nograd.schema.config import ModelConfig, TensorSpec
from nograd.schema.sequence_config import hidden_inputs, state_outputs
from nograd.schema.sequence_step import SequenceStep

Outputs = dict[str, np.ndarray]

TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    row.name: getattr(torch, row.torch) for row in TABLE if row.torch is not None
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
    responder: Any = None
    """Where a decoupled model sends this request's responses (``nograd.core.responses``)."""
    trace: Any = None
    """The request's trace when it is sampled (``nograd.observability.tracing``)."""
    sequence: SequenceStep | None = None
    """The sequence this request belongs to, for a sequence model."""

    def slice(self, start: int, stop: int) -> TensorPart:
        return TensorPart(
            {name: array[start:stop] for name, array in self.tensors.items()},
            stop - start,
            self.length,
            self.responder,
            self.trace,
            self.sequence,
        )


class SpeedPath(Protocol):
    """What a speed mode changes in a batch's run; ``nograd/runtime/speed/`` implements it."""

    @property
    def max_rows(self) -> int | None:
        """Largest batch (rows) one forward takes; larger batches run in chunks. None: any."""
        ...

    @property
    def sequence_inputs(self) -> frozenset[str]:
        """Collated tensors whose axis 1 is the sequence axis (padded to length buckets)."""
        ...

    @property
    def fixed_shapes(self) -> bool:
        """True when batches are padded to bucket shapes (compiled, or captured as CUDA graphs,
        per shape): the forward must then not change its shapes with the data, as a packed
        forward's token count does. False for precision alone (autocast)."""
        ...

    def padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        """The (rows, length) a batch of ``rows`` × ``length`` is zero-padded to."""
        ...

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The forward to run instead of ``handler.forward`` (autocast, CUDA graph replay)."""
        ...


class ModelHandler:
    """Default handler: each declared input goes to ``forward`` as a keyword tensor."""

    max_length: int | None = None
    """The longest sequence a token model reads (its truncation length): memory planning budgets
    a batch of tokens at this length. Sequence models set it; others leave it None."""

    synthetic_inputs: bool = True
    """False when ``example`` cannot make inputs the model reads: such a model runs on requests
    only, never on synthetic batches (no warm-up, memory profile or engine choice), and its batch
    limit is its config's (as a ``RequestRunner``'s is by default)."""

    prepare_offload: ClassVar[bool] = False
    """True when ``prepare`` is heavy (tokenising, decoding): the data plane runs it in a thread
    for requests above ``nograd.serving.validation.INLINE_PREPARE_BYTES``, on the event loop
    below."""

    def __init__(
        self, module: torch.nn.Module | None, config: ModelConfig, device: torch.device
    ) -> None:
        self.module = module
        """The eager forward's module; None when an engine holds the weights and runs every
        batch (an artifact, or the engines chosen at load serving every batch size)."""
        self.config = config
        self.device = device
        self.compute_dtype = torch.float32
        """Dtype floating inputs are cast to; fp32 until ``apply_speed`` casts the weights."""
        self.memory_format = torch.contiguous_format
        """Layout of 4-D float inputs: channels-last once ``apply_speed`` converts the weights."""
        self._inputs: dict[str, TensorSpec] = {spec.name: spec for spec in config.inputs}
        self._outputs: tuple[TensorSpec, ...] = config.outputs + state_outputs(config.sequence)
        self.speed_path: SpeedPath | None = None
        """Set by ``nograd.runtime.speed.guard.apply_speed`` when a faster mode passed its accuracy
        check."""
        self.speed_mode = "fp32"
        """The mode serving: fp32 eager, or the speed mode ``apply_speed`` accepted (bf16, …)."""

    # ----------------------------------------------------------------- request path (any thread)
    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Model-specific conversion of validated inputs; runs before queueing, off the device."""
        return tensor_part(inputs, self._inputs.values())

    @property
    def weights_bytes(self) -> int:
        """Bytes held by the module's parameters and buffers: what the model costs before any
        batch (0 without a module: its engine's weights are counted with the engine)."""
        return 0 if self.module is None else module_bytes(self.module)

    def example(self, rows: int, length: int = 1, seed: int = 0) -> TensorPart:
        """Synthetic inputs for warmup and memory profiling; variable dimensions get ``length``.

        ``seed`` 0 gives the warmup inputs; the speed modes' accuracy check also draws a
        held-out batch with another seed.
        """
        generator = default_rng(seed)
        tensors: dict[str, np.ndarray] = {}
        for spec in self.config.inputs + hidden_inputs(self.config.sequence):
            shape = (rows, *(length if d == -1 else d for d in spec.shape))
            tensors[spec.name] = _random_array(generator, spec.datatype, shape)
        return self.prepare(tensors)

    # ----------------------------------------------------------------- device thread
    def close(self) -> None:
        """Release what the model holds beyond its memory, when its version is freed."""

    def collate(self, parts: Sequence[TensorPart]) -> dict[str, torch.Tensor]:
        """Concatenate parts along the batch dimension, padding variable dimensions with zeros.

        With a fast path of fixed shapes, rows (and the sequence axis of token tensors) are
        zero-padded up to the bucket; ``to_numpy`` slices the padding rows off again.
        On CUDA the host tensor is pinned and copied with ``non_blocking``, and cast to the
        compute precision on the device: casting on the host would allocate a new, unpinned
        tensor and make the copy synchronous.
        """
        cuda = self.device.type == "cuda"
        rows: int | None = None
        length: int | None = None
        sequence: frozenset[str] = frozenset()
        if self.speed_path is not None:
            longest = max(part.length for part in parts)
            rows, length = self.speed_path.padded_shape(sum(part.rows for part in parts), longest)
            sequence = self.speed_path.sequence_inputs
        batch: dict[str, torch.Tensor] = {}
        for name in parts[0].tensors:
            arrays = [part.tensors[name] for part in parts]
            tensor = _pad_concat(
                arrays, pin_memory=cuda, rows=rows, length=length if name in sequence else None
            )
            tensor = tensor.to(self.device, non_blocking=cuda)
            if tensor.is_floating_point():
                tensor = tensor.to(self.compute_dtype)
                if tensor.ndim == 4 and self.memory_format is not torch.contiguous_format:
                    tensor = tensor.contiguous(memory_format=self.memory_format)
            batch[name] = tensor
        return batch

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        result = self.eager_module()(**batch)
        return self._name_outputs(result)

    def eager_module(self) -> torch.nn.Module:
        """The module the eager forward runs; an error for a model whose engine runs every
        batch (no eager module)."""
        if self.module is None:
            raise RuntimeError(
                f"model {self.config.name!r} has no eager module: its engine runs every batch"
            )
        return self.module

    def traced_forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The forward an engine's artifact captures (``nograd/runtime/engines/``): the same
        outputs, with no shape that follows the data. A handler whose forward has such shapes (a
        packed forward's token count) overrides this with its padded forward."""
        return self.forward(batch)

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

    def to_numpy(self, outputs: Mapping[str, torch.Tensor], rows: int | None = None) -> Outputs:
        """Outputs on the host, in each output's declared datatype; the first ``rows`` only.

        Slicing happens on the device, before the copy, so padding rows never cross the bus.
        ``.cpu()`` into pageable memory waits for the forward's stream, so no explicit
        synchronize is needed before numpy reads the result.
        """
        arrays: Outputs = {}
        for spec in self._outputs:
            tensor = outputs[spec.name].detach()
            if rows is not None and tensor.ndim > 0:
                tensor = tensor[:rows]
            if spec.datatype in TORCH_DTYPES:
                tensor = tensor.to(TORCH_DTYPES[spec.datatype])
            arrays[spec.name] = tensor.cpu().numpy()
        return arrays


class RunnerBase:
    """What every runner of a model's batches does alike: a part's row slices joined back, out of
    memory recognised, the device's cached blocks handed back after one."""

    device: torch.device

    def concat(self, results: Sequence[Outputs]) -> Outputs:
        return concat_outputs(results)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return is_out_of_memory(exc)

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class TorchRunner(RunnerBase):
    """The batcher's ``Runner`` for torch: collate, forward under inference_mode, fan out.

    ``path``: the forward to run, when not the handler's own ``speed_path`` (the engine choice
    times, and the memory plan measures, one engine at a time without touching the handler).
    Sharing the cores with other workers is ``nograd.runtime.runners.SharedCoresRunner``'s.
    """

    def __init__(self, handler: ModelHandler, path: SpeedPath | None = None) -> None:
        self.handler = handler
        self.device = handler.device
        self._path = path

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        rows = [part.rows for part in parts]
        fast = self._fast()
        most = None if fast is None else fast.max_rows
        if most is not None and sum(rows) > most:
            # Fixed shapes: a batch above the largest bucket runs as several bucket-sized
            # forwards rather than compiling (or capturing) a new shape under traffic.
            outputs = self.concat([self._forward(chunk) for chunk in chunk_rows(parts, most)])
        else:
            outputs = self._forward(parts)
        return split_rows(outputs, rows)

    def _forward(self, parts: Sequence[TensorPart]) -> Outputs:
        handler = self.handler
        with torch.inference_mode():
            batch = handler.collate(parts)
            fast = self._fast()
            result = handler.forward(batch) if fast is None else fast.forward(batch)
            return handler.to_numpy(result, rows=sum(part.rows for part in parts))

    def _fast(self) -> SpeedPath | None:
        return self.handler.speed_path if self._path is None else self._path


def tensor_part(inputs: Mapping[str, np.ndarray], specs: Iterable[TensorSpec]) -> TensorPart:
    """Validated inputs as one request's part: its rows, and as its length the first variable
    dimension of a declared input it carries (1 when none)."""
    rows = len(next(iter(inputs.values())))
    for spec in specs:
        for axis, dim in enumerate(spec.shape):
            if dim == -1 and spec.name in inputs:  # an optional input may be left out
                return TensorPart(dict(inputs), rows, int(inputs[spec.name].shape[axis + 1]))
    return TensorPart(dict(inputs), rows, 1)


def concat_outputs(results: Sequence[Outputs]) -> Outputs:
    """The outputs of consecutive row slices of one part, as one part's."""
    return {name: np.concatenate([r[name] for r in results]) for name in results[0]}


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes held by a module's parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def chunk_rows(parts: Sequence[TensorPart], most: int) -> list[list[TensorPart]]:
    """Consecutive groups of at most ``most`` rows, slicing a part where a group fills up."""
    chunks: list[list[TensorPart]] = [[]]
    room = most
    for part in parts:
        start = 0
        while start < part.rows:
            if room == 0:
                chunks.append([])
                room = most
            take = min(room, part.rows - start)
            chunks[-1].append(part if take == part.rows else part.slice(start, start + take))
            start += take
            room -= take
    return [chunk for chunk in chunks if chunk]


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


def _pad_concat(
    arrays: Sequence[np.ndarray],
    pin_memory: bool = False,
    rows: int | None = None,
    length: int | None = None,
) -> torch.Tensor:
    """One host tensor holding every part's rows, zero-padded along variable dimensions.

    ``rows`` and ``length`` (axis 1) pad further, to a fixed bucket shape; the padding is zeros.
    A single part already of the target shape is used in place (no copy). Otherwise parts are
    copied once into one torch allocation, which the memory profiler sees, and which is pinned
    when bound for a GPU so the host-to-device copy can run asynchronously.
    """
    target = [max(a.shape[axis] for a in arrays) for axis in range(arrays[0].ndim)]
    filled = sum(a.shape[0] for a in arrays)
    target[0] = max(filled, rows or 0)
    if length is not None and len(target) > 1:
        target[1] = max(target[1], length)
    if len(arrays) == 1 and not pin_memory and tuple(target) == arrays[0].shape:
        part = arrays[0]
        if part.flags.writeable and part.flags.c_contiguous:
            return torch.from_numpy(part)
        # A view of the request's bytes (binary and gRPC tensors) is read-only: a model that
        # changes its input in place (``x /= 255``) would write into an immutable object.
        return torch.from_numpy(np.array(part, order="C"))
    dtype = torch.from_numpy(arrays[0][:0]).dtype
    ragged = target[0] > filled or any(list(a.shape[1:]) != target[1:] for a in arrays)
    if not ragged and not pin_memory:
        # Same-shape parts (the common case): one C-level concatenation instead of a Python
        # loop of narrow/copy per part, which profiled at a fifth of digits' serving time.
        return torch.cat([torch.from_numpy(a) for a in arrays])
    make = torch.zeros if ragged else torch.empty
    out = make(tuple(target), dtype=dtype, pin_memory=pin_memory)
    start = 0
    for array in arrays:
        region = out[start : start + array.shape[0]]
        for axis, size in enumerate(array.shape[1:], start=1):
            region = region.narrow(axis, 0, size)
        region.copy_(torch.from_numpy(array))
        start += array.shape[0]
    return out


def _random_array(generator: Generator, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BOOL":
        return generator.integers(0, 2, size=shape).astype(np.bool_)
    if datatype.startswith(("INT", "UINT")):
        return generator.integers(0, 2, size=shape).astype(NUMPY_DTYPES[datatype])
    if datatype == "BYTES":
        return np.full(shape, b"warmup", dtype=np.object_)
    return generator.random(size=shape).astype(NUMPY_DTYPES[datatype])
