"""Engines as the handler's ``speed_path``: an opened engine runs the forward on the batch
``collate`` made, and ``to_numpy`` takes its outputs, so a model's pre- and post-processing (its
handler) stay the same whatever engine runs in between. Eager torch is one of them, so the
choice times, and the memory plan measures, every engine the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nograd.core.engines import EAGER
from nograd.host.heap import release_free_memory
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.handler import ModelHandler, SpeedPath
from nograd.runtime.memory import MemoryProbe, ProcessPeakProbe
from nograd.runtime.runners import Handler


class EnginePath:
    """An opened engine. The common part: variable shapes (no padding beyond ``collate``'s), no
    row cap, memory measured as the process's peak on CPU and the device probe's elsewhere."""

    name = "engine"

    def __init__(self, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.weights_bytes = 0
        """The artifact's size: what its weights cost in memory, about (set by ``open_engine``)."""

    @property
    def max_rows(self) -> int | None:
        return None

    @property
    def sequence_inputs(self) -> frozenset[str]:
        return frozenset()

    @property
    def fixed_shapes(self) -> bool:
        return False

    def padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        return rows, length

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def memory_probe(self, device_probe: MemoryProbe) -> MemoryProbe:
        """How this engine's memory is measured for the plan. On CPU the process's resident
        peak, which sees every allocator (torch's, oneDNN's scratch, an engine's own); on a GPU
        the device's probe (torch's caching allocator counts what torch engines allocate)."""
        if device_probe.device == "cpu":
            return ProcessPeakProbe()
        return device_probe

    def share_cores(self, widths: Sequence[int]) -> None:
        """Set up for a worker sharing the cores batch by batch (``widths``: the thread counts a
        batch may be granted). Nothing to do for an engine that runs on torch's threads."""

    def take_turns(self) -> None:
        """Set up for serving some batch sizes while another engine serves the others."""

    def release_memory(self) -> None:
        """Hand back what the engine keeps between runs, so serving starts from what the memory
        plan counted as idle. Nothing to do for an engine that keeps nothing."""

    @staticmethod
    def plain(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Float tensors in fp32 and contiguous, as the artifact was traced: beside an eager
        speed mode (bf16 weights, channels-last) ``collate`` may have made them otherwise."""
        return {
            name: tensor.to(torch.float32).contiguous() if tensor.is_floating_point() else tensor
            for name, tensor in batch.items()
        }

    def check_inputs(self, handler: ModelHandler) -> None:
        """The artifact takes exactly the tensors the handler collates, or the load fails."""
        collated = sorted(handler.collate([handler.example(1, 8)]))
        if collated != sorted(self.inputs):
            raise ArtifactError(
                f"the artifact takes inputs {sorted(self.inputs)}, the model's handler "
                f"collates {collated}"
            )


class EagerPath(EnginePath):
    """torch eager: the handler's own forward, through its speed mode's path when it has one
    (bf16, compile, CUDA graphs: ``nograd/runtime/speed/``)."""

    def __init__(self, handler: ModelHandler, speed: SpeedPath | None) -> None:
        super().__init__((), ())
        self.handler = handler
        self.speed = speed
        mode = handler.speed_mode
        self.name = EAGER if mode == "fp32" else f"{EAGER}+{mode}"

    @property
    def max_rows(self) -> int | None:
        return None if self.speed is None else self.speed.max_rows

    @property
    def sequence_inputs(self) -> frozenset[str]:
        return frozenset() if self.speed is None else self.speed.sequence_inputs

    @property
    def fixed_shapes(self) -> bool:
        return self.speed is not None and self.speed.fixed_shapes

    def padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        return (rows, length) if self.speed is None else self.speed.padded_shape(rows, length)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        if self.speed is not None:
            return self.speed.forward(batch)
        return self.handler.forward(batch)

    def check_inputs(self, handler: ModelHandler) -> None:
        """The handler's own forward takes what it collates."""


class OwnCodePath(EnginePath):
    """A model running its batches as its own code (``RequestRunner``), as it is: eager to the
    memory plan and the ready summary, with nothing of nograd's to forward through."""

    name = EAGER

    def __init__(self) -> None:
        super().__init__((), ())


class RangePath:
    """Several engines, each running the batches of a range of row counts it was timed fastest
    at; eager's range runs the handler's own forward (with its speed mode's path, if any)."""

    def __init__(self, ranges: Sequence[tuple[int, EnginePath]]) -> None:
        self.ranges = tuple(ranges)
        """(largest rows, engine) pairs, ascending; the last one takes every larger batch."""
        self._eager = next((e for _, e in self.ranges if isinstance(e, EagerPath)), None)
        self._last: EnginePath | None = None

    @property
    def max_rows(self) -> int | None:
        return None if self._eager is None else self._eager.max_rows

    @property
    def sequence_inputs(self) -> frozenset[str]:
        return frozenset() if self._eager is None else self._eager.sequence_inputs

    @property
    def fixed_shapes(self) -> bool:
        return self._eager is not None and self._eager.fixed_shapes

    def padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        return (rows, length) if self._eager is None else self._eager.padded_shape(rows, length)

    def engine_for(self, rows: int) -> EnginePath:
        """The engine that runs a batch of ``rows``."""
        for most, engine in self.ranges:
            if rows <= most:
                return engine
        return self.ranges[-1][1]

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        rows = next(iter(batch.values())).shape[0]
        engine = self.engine_for(rows)
        if engine is not self._last and self._last is not None:
            # What the other engine's batches left free in the C heap, this one's allocations
            # (an arena's regions) may not fit in: handed back, the two do not add up.
            release_free_memory()
        self._last = engine
        return engine.forward(batch)


def serving_ranges(handler: Handler) -> tuple[tuple[int | None, EnginePath], ...]:
    """What runs a handler's batches: (largest rows, engine) per range of batch sizes, ascending;
    None for the last range, which takes every larger batch."""
    path = handler.speed_path
    if isinstance(path, RangePath):
        ranges: list[tuple[int | None, EnginePath]] = list(path.ranges)
        ranges[-1] = (None, ranges[-1][1])
        return tuple(ranges)
    if isinstance(path, EnginePath):
        return ((None, path),)
    if not isinstance(handler, ModelHandler):
        return ((None, OwnCodePath()),)
    return ((None, EagerPath(handler, path)),)


def _engines(path: object) -> list[EnginePath]:
    if isinstance(path, RangePath):
        return [engine for _, engine in path.ranges]
    return [path] if isinstance(path, EnginePath) else []


def engine_weights_bytes(path: object) -> int:
    """The weights the engines of a handler's speed path hold (0 for eager's own paths)."""
    return sum(engine.weights_bytes for engine in _engines(path))


def share_cores(path: object, widths: Sequence[int]) -> None:
    """The engines of a handler's speed path set up for a worker that shares the cores batch by
    batch: each batch runs at the width the core ledger grants it."""
    for engine in _engines(path):
        engine.share_cores(widths)
