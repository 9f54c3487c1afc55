"""Speed levers, each behind an accuracy guard: lower precision, channels-last, torch.compile,
CUDA graphs.

A model is loaded as fp32 eager. When its config asks for a faster mode (``precision`` bf16 or
fp16, weights cast or ``autocast``; ``channels_last``; ``compile``; ``cuda_graphs``),
:func:`apply_speed` builds that mode on the same handler, compiles it during warmup by running
every shape it will see once, and compares its outputs with fp32 eager on the warmup inputs and on
a held-out batch drawn with another seed. The mode serves only when every float output stays within
``accuracy_tolerance`` (max abs error) and ``min_cosine`` (per-sample cosine similarity);
otherwise, or when building it raises (a compiler that cannot run, an op without a low-precision
kernel), the handler goes back to fp32 eager and a WARNING says why. A mode within tolerance must
also be fast on this machine: the warmup batches are timed in fp32 eager and in the mode, and a mode
under ``min_speedup`` times fp32 eager's speed is refused the same way (bf16 casts run 4-7x slower
than fp32 on a CPU without native bf16 arithmetic, measured on an AVX2-only AMD EPYC, while the
accuracy check passes them). The measured numbers are logged, and exported as
``nograd_model_accuracy_delta{model,mode}``, ``nograd_model_accuracy_cosine_min{model,mode}`` and
``nograd_model_speedup{model,mode}``.

Fixed shapes (``compile_buckets``, and ``compile_length_buckets`` for token models): every batch is
zero-padded up to the next bucket and the padding rows are sliced off the outputs, so the compiled
code (and each captured CUDA graph) only ever sees the shapes compiled during warmup. A batch larger
than the largest bucket runs as several bucket-sized forwards; :func:`batch_cap` tells the data
plane the largest batch worth forming. Each compiled region may hold as many compiled entries as
warmup made (``recompile_limit``), so a shape traffic has never shown runs eager instead of
recompiling under load.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, cast

import numpy as np
import torch

from nograd.core.datatypes import datatype_of, shape_matches
from nograd.observability.metrics import Metrics
from nograd.protocol.v2 import decode_body
from nograd.runtime.config import ModelConfig
from nograd.runtime.handler import PRECISION_DTYPES, ModelHandler, Outputs, TensorPart, TorchRunner
from nograd.runtime.loader import LoadError, inside
from nograd.runtime.warmup import warmup_shapes

logger = logging.getLogger(__name__)

LOW_PRECISION_TOLERANCE: Final = 1e-2
"""Default max abs error for bf16/fp16: bf16 keeps 8 significant bits (~0.4% relative), so
outputs of order 1 drift by a few 1e-3 (docs/speed.md has the measured values)."""
FP32_TOLERANCE: Final = 1e-4
"""Default max abs error for fp32 with channels-last, compile or CUDA graphs: other kernels,
reordered reductions and fused ops, not lost precision, so the drift is near fp32 rounding."""
HELD_OUT_SEED: Final = 1
"""``ModelHandler.example`` seed of the held-out batch; seed 0 draws the warmup inputs."""
SPEED_PASSES: Final = 3
"""Timed passes over the warmup batches, for fp32 eager and for the mode; each batch counts at its
fastest pass, since another process on the machine can only slow a pass down."""
GRAPH_WARMUP_RUNS: Final = 3
"""Forwards on a side stream before a capture: lazy init (cuBLAS handles, autotuning) must not
happen inside the graph."""

Shape = tuple[int, int]
"""(rows, length) of a batch; length is 1 for models without a sequence axis."""


# --------------------------------------------------------------------------------------- buckets
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


# ------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class SpeedPlan:
    """The levers a model's config asks for, after dropping those its device cannot use."""

    precision: str
    autocast: bool
    channels_last: bool
    compile: bool
    compile_mode: str
    buckets: Buckets | None
    cuda_graphs: bool
    tolerance: float
    min_cosine: float
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


def plan_for(config: ModelConfig, device: torch.device) -> SpeedPlan:
    """What to build for ``config`` on ``device``; CUDA-only levers on CPU are dropped, logged."""
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
    tolerance = config.accuracy_tolerance
    if tolerance is None:
        tolerance = LOW_PRECISION_TOLERANCE if config.precision != "fp32" else FP32_TOLERANCE
    return SpeedPlan(
        precision=config.precision,
        autocast=config.autocast,
        channels_last=config.channels_last,
        compile=config.compile,
        compile_mode=config.compile_mode,
        buckets=buckets,
        cuda_graphs=cuda_graphs,
        tolerance=tolerance,
        min_cosine=config.min_cosine,
        min_speedup=config.min_speedup,
    )


# ----------------------------------------------------------------------------- accuracy check
@dataclass(frozen=True)
class OutputDelta:
    """One output against fp32 eager over every check batch."""

    name: str
    max_abs_error: float | None = None
    """Float outputs: largest absolute difference of any element."""
    min_cosine: float | None = None
    """Float outputs: smallest cosine similarity of one sample's values (flattened)."""
    match_rate: float | None = None
    """Integer and boolean outputs: fraction of elements exactly equal."""


@dataclass(frozen=True)
class AccuracyReport:
    """How far a mode's outputs are from fp32 eager; the guard decides on the float outputs."""

    outputs: tuple[OutputDelta, ...]
    batches: int

    @property
    def max_abs_error(self) -> float:
        errors = [o.max_abs_error for o in self.outputs if o.max_abs_error is not None]
        return _worst(max, errors) if errors else 0.0

    @property
    def min_cosine(self) -> float:
        cosines = [o.min_cosine for o in self.outputs if o.min_cosine is not None]
        return _worst(min, cosines) if cosines else 1.0

    def problems(self, tolerance: float, min_cosine: float) -> list[str]:
        """Why the mode must be refused; empty when it may serve."""
        found = []
        for out in self.outputs:
            error, cosine = out.max_abs_error, out.min_cosine
            if error is not None and not error <= tolerance:  # NaN fails too
                found.append(
                    f"output {out.name!r} max abs error {error:.3g} exceeds "
                    f"accuracy_tolerance {tolerance:.3g}"
                )
            if cosine is not None and not cosine >= min_cosine:
                found.append(
                    f"output {out.name!r} min cosine {cosine:.6f} is below min_cosine "
                    f"{min_cosine:.6f}"
                )
        return found

    def summary(self) -> str:
        parts = []
        for out in self.outputs:
            if out.max_abs_error is not None:
                parts.append(
                    f"{out.name}: max abs error {out.max_abs_error:.3g}, "
                    f"min cosine {out.min_cosine:.6f}"
                )
            elif out.match_rate is not None:
                parts.append(f"{out.name}: exact match {100 * out.match_rate:.1f}%")
        return "; ".join(parts)


def compare(reference: Sequence[Outputs], candidate: Sequence[Outputs]) -> AccuracyReport:
    """Max abs error and min per-sample cosine of float outputs; exact match rate of the rest."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} candidate results for {len(reference)} references")
    if not reference:
        return AccuracyReport((), 0)
    deltas = []
    for name in reference[0]:
        pairs = [(ref[name], cand[name]) for ref, cand in zip(reference, candidate, strict=True)]
        for ref_array, cand_array in pairs:
            if ref_array.shape != cand_array.shape:
                raise ValueError(
                    f"output {name!r} has shape {list(cand_array.shape)}, fp32 eager gave "
                    f"{list(ref_array.shape)}"
                )
        if np.issubdtype(pairs[0][0].dtype, np.floating):
            error = _worst(max, [_max_abs_error(ref, cand) for ref, cand in pairs])
            cosine = _worst(min, [_min_cosine(ref, cand) for ref, cand in pairs])
            deltas.append(OutputDelta(name, max_abs_error=error, min_cosine=cosine))
        else:
            equal = sum(int(np.count_nonzero(ref == cand)) for ref, cand in pairs)
            total = sum(ref.size for ref, _ in pairs)
            deltas.append(OutputDelta(name, match_rate=equal / total if total else 1.0))
    return AccuracyReport(tuple(deltas), len(reference))


def _worst(pick: Callable[[list[float]], float], values: list[float]) -> float:
    """``max``/``min`` where NaN wins: Python's own would drop it depending on the order."""
    return float(np.nan) if any(np.isnan(v) for v in values) else pick(values)


def _max_abs_error(reference: np.ndarray, candidate: np.ndarray) -> float:
    if reference.size == 0:
        return 0.0
    diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    return float(np.nan) if np.isnan(diff).any() else float(diff.max())


def _min_cosine(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Smallest cosine of a sample's flattened values; two all-zero samples count as equal."""
    if reference.size == 0:
        return 1.0
    if np.isnan(reference).any() or np.isnan(candidate).any():
        return float(np.nan)
    ref = reference.reshape(reference.shape[0], -1).astype(np.float64)
    cand = candidate.reshape(candidate.shape[0], -1).astype(np.float64)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    dots = (ref * cand).sum(axis=1)
    both_zero = (np.linalg.norm(ref, axis=1) == 0) & (np.linalg.norm(cand, axis=1) == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = np.where(both_zero, 1.0, np.where(norms > 0, dots / norms, 0.0))
    return float(cosine.min())


# --------------------------------------------------------------------------------- CUDA graphs
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


# ---------------------------------------------------------------------------------- fast path
class SpeedPath:
    """The handler's ``fast_path``: bucket padding, autocast, and CUDA graph replay."""

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


def batch_cap(handler: ModelHandler) -> int | None:
    """Largest batch worth forming, in the model's batch unit, or None when nothing caps it.

    With fixed shapes, a batch above the largest bucket runs as several forwards, so the data
    plane should cap the batcher's limit here: rows for sample models, and for token models the
    largest rows × largest length bucket.
    """
    fast = handler.fast_path
    if not isinstance(fast, SpeedPath) or fast.buckets is None:
        return None
    buckets = fast.buckets
    if handler.config.batch_unit == "tokens" and buckets.lengths is not None:
        return buckets.max_rows * buckets.lengths[-1]
    return buckets.max_rows


# --------------------------------------------------------------------------- building a mode
@dataclass
class _Snapshot:
    """fp32 weights kept while a weight-cast mode is checked, to restore them exactly."""

    parameters: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def take(cls, module: torch.nn.Module, offload: bool) -> _Snapshot:
        """References to the fp32 tensors (on CPU no copy); GPU tensors go to host memory, so
        the check costs no device memory beyond the low-precision copy."""

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.detach().to("cpu") if offload else tensor.detach()

        snapshot = cls()
        for parameter in module.parameters():
            if parameter.is_floating_point():
                snapshot.parameters.append((parameter, keep(parameter.data)))
        for name, buffer in module.named_buffers():
            if buffer.is_floating_point():
                owner_name, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                snapshot.buffers.append((owner, leaf, keep(buffer)))
        return snapshot

    def restore(self, device: torch.device) -> None:
        for parameter, saved in self.parameters:
            parameter.data = saved.to(device)
        for owner, leaf, saved in self.buffers:
            setattr(owner, leaf, saved.to(device))


@dataclass
class _Original:
    """The fp32 eager state of a handler, to go back to when a mode is refused."""

    module: torch.nn.Module
    compute_dtype: torch.dtype
    snapshot: _Snapshot | None

    def restore(self, handler: ModelHandler) -> None:
        handler.speed_mode = "fp32"
        handler.fast_path = None
        handler.module = self.module
        if self.snapshot is not None:
            self.snapshot.restore(handler.device)
        handler.compute_dtype = self.compute_dtype
        if handler.memory_format is not torch.contiguous_format:
            _set_memory_format(handler, torch.contiguous_format)


@dataclass(frozen=True)
class CheckBatch:
    """One batch of the accuracy check: warmup (compiles a shape) or held-out."""

    kind: str
    part: TensorPart


def check_batches(
    handler: ModelHandler, plan: SpeedPlan, limit: int, model_dir: Path | None = None
) -> list[CheckBatch]:
    """Warmup inputs (every bucket, or the usual warmup shapes), a held-out sample, and the
    model's ``accuracy_sample`` of real inputs when its config names one.

    The held-out rows and lengths are off the buckets on purpose, so padding and slicing are
    part of what is checked; with buckets one held-out batch is above the largest, to check the
    chunked path.
    """
    tokens = handler.config.batch_unit == "tokens"
    warm = plan.buckets.shapes() if plan.buckets is not None else warmup_shapes(handler, limit)
    batches = [CheckBatch("warmup", handler.example(rows, length)) for rows, length in warm]
    held: list[Shape]
    if tokens:
        held = [(r, n) for r, n in ((3, 24), (5, 56)) if r * n <= max(limit, 3 * 24)]
    else:
        top = max(1, min(limit, 13))
        held = [(rows, 1) for rows in sorted({min(3, top), top})]
    if plan.buckets is not None:
        rows = plan.buckets.max_rows + max(1, plan.buckets.max_rows // 2)
        held.append((rows, 24 if tokens else 1))
    batches.extend(
        CheckBatch("held-out", handler.example(rows, length, seed=HELD_OUT_SEED))
        for rows, length in held
    )
    if handler.config.accuracy_sample is not None and model_dir is not None:
        batches.append(CheckBatch("held-out", load_sample(handler, model_dir)))
    return batches


def load_sample(handler: ModelHandler, model_dir: Path) -> TensorPart:
    """The config's ``accuracy_sample``: a V2 request body, decoded and prepared as a request.

    A sample that cannot be read fails the load, naming the file and the field, like any other
    config mistake.
    """
    name = handler.config.accuracy_sample
    assert name is not None
    path = model_dir / name
    try:
        inside(model_dir, path)
        request = decode_body(path.read_bytes(), None)
        declared = sorted(spec.name for spec in handler.config.inputs)
        if sorted(request.inputs) != declared:
            raise ValueError(f"has inputs {sorted(request.inputs)}, the model takes {declared}")
        for spec in handler.config.inputs:
            array = request.inputs[spec.name]
            actual = datatype_of(array)
            if actual != spec.datatype or not shape_matches(spec.shape, tuple(array.shape[1:])):
                raise ValueError(
                    f"input {spec.name!r} is {actual} {list(array.shape)}; the model takes "
                    f"{spec.datatype} [-1, {', '.join(map(str, spec.shape))}]"
                )
        return handler.prepare(request.inputs)
    except (OSError, ValueError, LoadError) as exc:
        raise ValueError(f"{path}: field 'accuracy_sample': {exc}") from exc


def sequence_inputs(handler: ModelHandler) -> frozenset[str]:
    """Collated tensors whose axis 1 follows the sequence length (seen by varying it)."""
    if handler.config.batch_unit != "tokens":
        return frozenset()
    short, long = handler.example(1, 8).tensors, handler.example(1, 16).tensors
    return frozenset(
        name
        for name, array in short.items()
        if array.ndim >= 2 and long[name].ndim >= 2 and array.shape[1] != long[name].shape[1]
    )


# -------------------------------------------------------------------------------- speed check
@dataclass(frozen=True)
class SpeedReport:
    """The warmup batches timed in fp32 eager and in the mode (seconds, fastest pass of each)."""

    fp32_seconds: tuple[float, ...]
    mode_seconds: tuple[float, ...]

    @property
    def speedup(self) -> float:
        """fp32 eager's time over the mode's, for all the batches together: above 1 is faster."""
        return sum(self.fp32_seconds) / max(sum(self.mode_seconds), 1e-12)

    def summary(self) -> str:
        pairs = zip(self.fp32_seconds, self.mode_seconds, strict=True)
        each = [fp32 / max(mode, 1e-12) for fp32, mode in pairs]
        return (
            f"{self.speedup:.2f}x fp32 eager's speed over {len(each)} warmup batches "
            f"({_ms(sum(self.mode_seconds))} ms against fp32 eager's "
            f"{_ms(sum(self.fp32_seconds))} ms; "
            f"per batch {min(each):.2f}x to {max(each):.2f}x)"
        )


def _ms(seconds: float) -> str:
    milliseconds = 1e3 * seconds
    return f"{milliseconds:,.0f}" if milliseconds >= 100 else f"{milliseconds:.3g}"


def time_batches(
    runner: TorchRunner,
    batches: Sequence[CheckBatch],
    passes: int = SPEED_PASSES,
    give_up_above: float = math.inf,
) -> tuple[float, ...]:
    """Seconds of each batch at its fastest of ``passes`` passes, collate and copy back included
    (``run_batch`` returns host arrays, so a GPU forward has finished when it returns).

    Stops after a pass once the batches' fastest times already add up to more than
    ``give_up_above``: more passes could only lower them by the noise, and a mode that far behind
    is refused anyway, so a bf16 model on a CPU without bf16 costs start-up only one slow pass.
    """
    best = [math.inf] * len(batches)
    for _ in range(passes):
        for index, batch in enumerate(batches):
            started = time.perf_counter()
            runner.run_batch([batch.part])
            best[index] = min(best[index], time.perf_counter() - started)
        if sum(best) > give_up_above:
            break
    return tuple(best)


def _build(handler: ModelHandler, plan: SpeedPlan, warm_shapes: int) -> SpeedPath | None:
    """Turn the fp32 eager handler into ``plan``'s mode (before any forward compiles it)."""
    dtype = PRECISION_DTYPES[plan.precision]
    if plan.casts_weights:
        handler.module.to(dtype)
        handler.compute_dtype = dtype
    if plan.channels_last:
        _set_memory_format(handler, torch.channels_last)
    if plan.compile:
        handler.module = _compile(handler.module, plan, warm_shapes)
    autocast = dtype if plan.autocast else None
    if plan.buckets is None and autocast is None and not plan.cuda_graphs:
        return None
    path = SpeedPath(handler, plan.buckets, sequence_inputs(handler), autocast)
    handler.fast_path = path
    return path


def _set_memory_format(handler: ModelHandler, memory_format: torch.memory_format) -> None:
    """The weights (4-D ones; others have no such layout) and the inputs ``collate`` builds."""
    # Module.to takes memory_format at run time; its typed overloads leave it out.
    to = cast(Callable[..., torch.nn.Module], handler.module.to)
    to(memory_format=memory_format)
    handler.memory_format = memory_format


def _compile(module: torch.nn.Module, plan: SpeedPlan, warm_shapes: int) -> torch.nn.Module:
    compile_fn = cast(Callable[..., torch.nn.Module], torch.compile)
    mode = plan.compile_mode
    if plan.cuda_graphs and mode == "max-autotune":
        # Our own graphs capture the compiled code; inductor's would nest inside them.
        mode = "max-autotune-no-cudagraphs"
    options: dict[str, object] = {
        "mode": mode,
        # Fixed shapes: one specialised graph per bucket. Otherwise symbolic sizes, so a new
        # batch size or text length reuses a graph compiled during warmup.
        "dynamic": plan.buckets is None,
    }
    if _accepts(compile_fn, "recompile_limit"):
        # Only the compiles warmup makes: a shape traffic has not shown runs eager rather than
        # stalling a batch for a recompile. Isolated, so another model running the same code
        # (two BERTs) does not use up this one's entries. (torch >= 2.13; older torch keeps
        # its global limit of 8 per code object.)
        options["recompile_limit"] = max(1, warm_shapes)
        options["isolate_recompiles"] = True
    return compile_fn(module, **options)


def _accepts(fn: Callable[..., object], name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _run_all(runner: TorchRunner, batches: Sequence[CheckBatch]) -> list[Outputs]:
    return [runner.run_batch([batch.part])[0] for batch in batches]


def _capture_graphs(handler: ModelHandler, path: SpeedPath, batches: Sequence[CheckBatch]) -> None:
    graphs = CudaGraphs(handler.device)
    with torch.inference_mode():
        collated = [handler.collate([b.part]) for b in batches if b.kind == "warmup"]
        graphs.capture(path.eager_forward, collated)
    path.graphs = graphs


def _release(device: torch.device) -> None:
    """Hand blocks freed by the check (fp32 copy, refused mode) back to the device, so the
    memory plan that runs next sees them as free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def apply_speed(
    handler: ModelHandler,
    limit: int,
    metrics: Metrics | None = None,
    model_dir: Path | None = None,
) -> ModelHandler:
    """The handler to serve: ``handler`` in the config's faster mode, or fp32 eager if refused.

    ``handler`` must be fp32 eager (as ``build_handler`` returns it). ``limit`` is the batch cap
    warmup uses (samples or padded tokens); ``model_dir`` is where ``accuracy_sample`` lives. Runs
    the mode's compiles, so it belongs in warmup, on the thread that loads the model.
    """
    config = handler.config
    plan = plan_for(config, handler.device)
    if not plan.requested:
        return handler
    mode = plan.mode
    batches = check_batches(handler, plan, limit, model_dir)
    warmup = [b for b in batches if b.kind == "warmup"]
    runner = TorchRunner(handler)
    reference = _run_all(runner, batches)
    fp32_seconds = time_batches(runner, warmup) if plan.min_speedup > 0 else None
    original = _Original(
        handler.module,
        handler.compute_dtype,
        _Snapshot.take(handler.module, handler.device.type == "cuda")
        if plan.casts_weights
        else None,
    )
    started = time.perf_counter()
    speed: SpeedReport | None = None
    try:
        path = _build(handler, plan, len(warmup))
        candidate = _run_all(runner, batches)
        if plan.cuda_graphs and path is not None:
            _capture_graphs(handler, path, batches)
            candidate = _run_all(runner, batches)
        report = compare(reference, candidate)
        seconds = time.perf_counter() - started  # built, compiled and checked; timing excluded
        problems = report.problems(plan.tolerance, plan.min_cosine)
        if fp32_seconds is not None and not problems:
            hopeless = 2 * sum(fp32_seconds) / plan.min_speedup
            speed = SpeedReport(fp32_seconds, time_batches(runner, warmup, give_up_above=hopeless))
    except Exception as exc:
        original.restore(handler)
        _release(handler.device)
        logger.warning(
            "model %s: speed mode %s refused, serving fp32 eager: building it failed after "
            "%.1fs: %s",
            config.name,
            mode,
            time.perf_counter() - started,
            _first_line(exc),
        )
        logger.debug("model %s: speed mode %s failure", config.name, mode, exc_info=True)
        return handler
    if metrics is not None:
        metrics.accuracy_delta.labels(config.name, mode).set(report.max_abs_error)
        metrics.accuracy_cosine_min.labels(config.name, mode).set(report.min_cosine)
        if speed is not None:
            metrics.speedup.labels(config.name, mode).set(speed.speedup)
    if speed is not None and not speed.speedup >= plan.min_speedup:
        problems.append(f"{speed.summary()}, under min_speedup {plan.min_speedup:g}")
    checked = f"{len(warmup)} warmup + {len(batches) - len(warmup)} held-out batches"
    if problems:
        original.restore(handler)
        _release(handler.device)
        logger.warning(
            "model %s: speed mode %s refused, serving fp32 eager: %s (%s; %s)",
            config.name,
            mode,
            "; ".join(problems),
            report.summary(),
            checked,
        )
        return handler
    handler.speed_mode = mode
    original.snapshot = None  # the fp32 copy is only needed while the mode can still be refused
    _release(handler.device)
    logger.info(
        "model %s: speed mode %s accepted: %s (tolerance %.3g, min cosine %.6f; %s; built%s in "
        "%.1fs); %s",
        config.name,
        mode,
        report.summary(),
        plan.tolerance,
        plan.min_cosine,
        checked,
        " and compiled" if plan.compile else "",
        seconds,
        "speed not checked (min_speedup 0)" if speed is None else speed.summary(),
    )
    return handler
