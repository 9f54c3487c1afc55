"""The handler's speed path once a mode is accepted: bucket padding, autocast, CUDA graph replay."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Final

import torch

from nograd.runtime.handler import ModelHandler
from nograd.runtime.runners import Handler
from nograd.runtime.speed.mode import Buckets, Shape

GRAPH_WARMUP_RUNS: Final = 3
"""Forwards on a side stream before a capture: lazy init (cuBLAS handles, autotuning) must not
happen inside the graph."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def _shape_key(batch: Mapping[str, torch.Tensor]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(sorted((name, tuple(tensor.shape)) for name, tensor in batch.items()))


class CudaGraphs:
    """One captured CUDA graph per bucket shape, with static input and output buffers.

    Replay copies a batch into the captured inputs and returns the captured outputs: those are
    overwritten by the next replay, which is safe because ``to_numpy`` copies them to the host
    before the device thread starts another batch. Graphs share one memory pool and are captured
    largest first, so smaller graphs reuse the larger ones' intermediate blocks; sharing is safe
    because replays never overlap (one device thread, one stream) and each graph's outputs stay
    referenced, so no other capture can be handed their memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[tuple[tuple[str, tuple[int, ...]], ...], _Captured] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(
        self,
        forward: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
        batches: Sequence[Mapping[str, torch.Tensor]],
    ) -> None:
        """Capture ``forward`` once per batch shape; call under ``torch.inference_mode``."""
        pool = torch.cuda.graph_pool_handle()
        largest_first = sorted(batches, key=lambda b: -sum(t.numel() for t in b.values()))
        for batch in largest_first:
            key = _shape_key(batch)
            if key in self._graphs:
                continue
            static_inputs = {name: tensor.clone() for name, tensor in batch.items()}
            # Lazy initialisation inside a capture is illegal: run a few forwards on a side
            # stream first, as the CUDA graphs notes prescribe.
            side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP_RUNS):
                    forward(static_inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (a metrics scrape reading memory) must not
            # invalidate this capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                static_outputs = dict(forward(static_inputs))
            self._graphs[key] = _Captured(graph, static_inputs, static_outputs)

    def replay(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor] | None:
        """The captured outputs for ``batch``, or None when its shape was not captured."""
        captured = self._graphs.get(_shape_key(batch))
        if captured is None:
            return None
        for name, tensor in batch.items():
            captured.inputs[name].copy_(tensor, non_blocking=True)
        captured.graph.replay()
        return captured.outputs


class SpeedModePath:
    """The handler's ``speed_path``: bucket padding, autocast, and CUDA graph replay."""

    def __init__(
        self,
        handler: ModelHandler,
        buckets: Buckets | None,
        sequence_inputs: frozenset[str],
        autocast_dtype: torch.dtype | None,
    ) -> None:
        self._handler = handler
        self.buckets = buckets
        self._sequence_inputs = sequence_inputs
        self._autocast_dtype = autocast_dtype
        self.graphs: CudaGraphs | None = None

    @property
    def max_rows(self) -> int | None:
        return None if self.buckets is None else self.buckets.max_rows

    @property
    def sequence_inputs(self) -> frozenset[str]:
        return self._sequence_inputs

    @property
    def fixed_shapes(self) -> bool:
        # CUDA graphs need buckets (the config refuses them without), so buckets decide.
        return self.buckets is not None

    def padded_shape(self, rows: int, length: int) -> Shape:
        return (rows, length) if self.buckets is None else self.buckets.fit(rows, length)

    def eager_forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The handler's forward (compiled or not) under autocast when asked; what graphs hold."""
        with self._autocast():
            return self._handler.forward(batch)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        if self.graphs is not None:
            outputs = self.graphs.replay(batch)
            if outputs is not None:
                return outputs
        return self.eager_forward(batch)

    def _autocast(self) -> AbstractContextManager[object]:
        if self._autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self._handler.device.type, dtype=self._autocast_dtype)


def batch_cap(handler: Handler) -> int | None:
    """Largest batch worth forming, in the model's batch unit, or None when nothing caps it.

    With fixed shapes, a batch above the largest bucket runs as several forwards, so the data
    plane should cap the batcher's limit here: rows for sample models, and for token models the
    largest rows × largest length bucket.
    """
    fast = handler.speed_path
    if not isinstance(fast, SpeedModePath) or fast.buckets is None:
        return None
    buckets = fast.buckets
    if handler.config.batch_unit == "tokens" and buckets.lengths is not None:
        return buckets.max_rows * buckets.lengths[-1]
    return buckets.max_rows
