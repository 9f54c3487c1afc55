"""What a model's config asks of its speed mode, after dropping what its device cannot use.

A speed mode (lower precision, channels-last, torch.compile, CUDA graphs; docs/speed.md) serves only
after the accuracy guard (``nograd.runtime.speed.guard``) accepts it. Fixed shapes
(``compile_buckets``, and ``compile_length_buckets`` for token models) pad every batch up to the
next bucket, so compiled code and captured CUDA graphs only see shapes compiled during warmup.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from nograd.schema.config import ModelConfig

logger = logging.getLogger(__name__)

LOW_PRECISION_TOLERANCE: Final = 1e-2
"""Default max abs error for bf16/fp16: bf16 keeps 8 significant bits (~0.4% relative), so
outputs of order 1 drift by a few 1e-3 (docs/speed.md has the measured values)."""
FP32_TOLERANCE: Final = 1e-4
"""Default max abs error for fp32 with channels-last, compile or CUDA graphs: other kernels,
reordered reductions and fused ops, not lost precision, so the drift is near fp32 rounding."""
Shape = tuple[int, int]
"""(rows, length) of a batch; length is 1 for models without a sequence axis."""


def next_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket holding ``size``; ``size`` itself when it is above every bucket."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return size


@dataclass(frozen=True)
class Buckets:
    """Fixed batch shapes: row counts, and for token models sequence lengths."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...] | None = None

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    def fit(self, rows: int, length: int) -> Shape:
        """The bucket shape a batch is padded to (unchanged along an axis it outgrows)."""
        padded_length = length if self.lengths is None else next_bucket(self.lengths, length)
        return next_bucket(self.rows, rows), padded_length

    def shapes(self) -> list[Shape]:
        """Every bucket shape, the order warmup compiles them in."""
        return [(rows, length) for length in (self.lengths or (1,)) for rows in self.rows]


@dataclass(frozen=True)
class SpeedMode:
    """The options a model's config asks for, after dropping those its device cannot use."""

    precision: str
    autocast: bool
    channels_last: bool
    compile: bool
    compile_mode: str
    buckets: Buckets | None
    cuda_graphs: bool
    tolerance: float
    min_cosine: float
    min_match_rate: float | None
    min_speedup: float

    @property
    def requested(self) -> bool:
        return self.precision != "fp32" or self.channels_last or self.compile or self.cuda_graphs

    @property
    def casts_weights(self) -> bool:
        return self.precision != "fp32" and not self.autocast

    @property
    def mode(self) -> str:
        """The ``mode`` label: e.g. ``bf16``, ``bf16-autocast``, ``channels_last``,
        ``bf16+compile``."""
        parts = []
        if self.precision != "fp32":
            parts.append(self.precision + ("-autocast" if self.autocast else ""))
        if self.channels_last:
            parts.append("channels_last")
        if self.compile:
            parts.append("compile" if self.compile_mode == "default" else self.compile_mode)
        if self.cuda_graphs:
            parts.append("cudagraphs")
        return "+".join(parts) or "fp32"


def mode_for(config: ModelConfig, device: torch.device) -> SpeedMode:
    """What to build for ``config`` on ``device``; CUDA-only options on CPU are dropped, logged."""
    cuda_graphs = config.cuda_graphs
    if cuda_graphs and device.type != "cuda":
        logger.warning(
            "model %s: cuda_graphs = true is ignored on %s (CUDA graphs need a GPU)",
            config.name,
            device.type,
        )
        cuda_graphs = False
    buckets = None
    if config.compile_buckets is not None and (config.compile or cuda_graphs):
        buckets = Buckets(config.compile_buckets, config.compile_length_buckets)
    # int8 is an engine's precision (nograd/runtime/engines/); torch eager stays fp32.
    precision = "fp32" if config.precision == "int8" else config.precision
    tolerance = config.accuracy_tolerance
    if tolerance is None:
        tolerance = LOW_PRECISION_TOLERANCE if precision != "fp32" else FP32_TOLERANCE
    return SpeedMode(
        precision=precision,
        autocast=config.autocast,
        channels_last=config.channels_last,
        compile=config.compile,
        compile_mode=config.compile_mode,
        buckets=buckets,
        cuda_graphs=cuda_graphs,
        tolerance=tolerance,
        min_cosine=config.min_cosine,
        min_match_rate=config.min_match_rate,
        min_speedup=config.min_speedup,
    )
