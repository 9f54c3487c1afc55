"""Building a speed mode on a loaded handler behind the accuracy guard.

The mode is built on the same handler, compiled during warmup by running every shape it will see,
and compared with fp32 eager on the warmup inputs and on a held-out batch. It serves only when
every float output stays within ``accuracy_tolerance`` and ``min_cosine`` and, timed on the warmup
batches, it runs at least ``min_speedup`` times fp32 eager's speed on this machine (a CPU without
native bf16 arithmetic passes bf16 on accuracy yet runs it slower; docs/speed.md). Otherwise, or
when building it raises, the handler goes back to fp32 eager and a WARNING says why. The check's
numbers go to whoever asked for them (the serving layer exports them as metrics).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, cast

import torch

from nograd.runtime.handler import PRECISION_DTYPES, ModelHandler, Outputs, TensorPart, TorchRunner
from nograd.runtime.speed.accuracy import AccuracyReport, compare
from nograd.runtime.speed.mode import Shape, SpeedMode, mode_for
from nograd.runtime.speed.path import CudaGraphs, SpeedModePath
from nograd.runtime.warmup import warmup_shapes

logger = logging.getLogger(__name__)

HELD_OUT_SEED: Final = 1
"""``ModelHandler.example`` seed of the held-out batch; seed 0 draws the warmup inputs."""
SPEED_PASSES: Final = 3
"""Timed passes over the warmup batches, for fp32 eager and for the mode; each batch counts at its
fastest pass, since another process on the machine can only slow a pass down."""


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
        handler.speed_path = None
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
    handler: ModelHandler, plan: SpeedMode, limit: int, sample: TensorPart | None = None
) -> list[CheckBatch]:
    """Warmup inputs (every bucket, or the usual warmup shapes), a held-out sample, and
    ``sample``, real inputs (the config's ``accuracy_sample``), when given.

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
    if sample is not None:
        batches.append(CheckBatch("held-out", sample))
    return batches


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


def _build(handler: ModelHandler, plan: SpeedMode, warm_shapes: int) -> SpeedModePath | None:
    """Turn the fp32 eager handler into ``plan``'s mode (before any forward compiles it)."""
    dtype = PRECISION_DTYPES[plan.precision]
    if plan.casts_weights:
        handler.eager_module().to(dtype)
        handler.compute_dtype = dtype
    if plan.channels_last:
        _set_memory_format(handler, torch.channels_last)
    if plan.compile:
        handler.module = _compile(handler.eager_module(), plan, warm_shapes)
    autocast = dtype if plan.autocast else None
    if plan.buckets is None and autocast is None and not plan.cuda_graphs:
        return None
    path = SpeedModePath(handler, plan.buckets, sequence_inputs(handler), autocast)
    handler.speed_path = path
    return path


def _set_memory_format(handler: ModelHandler, memory_format: torch.memory_format) -> None:
    """The weights (4-D ones; others have no such layout) and the inputs ``collate`` builds."""
    # Module.to takes memory_format at run time; its typed overloads leave it out.
    to = cast(Callable[..., torch.nn.Module], handler.eager_module().to)
    to(memory_format=memory_format)
    handler.memory_format = memory_format


def _compile(module: torch.nn.Module, plan: SpeedMode, warm_shapes: int) -> torch.nn.Module:
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


def run_all(runner: TorchRunner, batches: Sequence[CheckBatch]) -> list[Outputs]:
    return [runner.run_batch([batch.part])[0] for batch in batches]


def _capture_graphs(
    handler: ModelHandler, path: SpeedModePath, batches: Sequence[CheckBatch]
) -> None:
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


@dataclass(frozen=True)
class SpeedCheck:
    """What the guard measured of a mode it could build: for the caller to export."""

    model: str
    mode: str
    accuracy: AccuracyReport
    speed: SpeedReport | None
    """None when ``min_speedup`` is 0 or the mode failed the accuracy check first."""


def apply_speed(
    handler: ModelHandler,
    limit: int,
    sample: TensorPart | None = None,
    report_check: Callable[[SpeedCheck], None] | None = None,
) -> ModelHandler:
    """The handler to serve: ``handler`` in the config's faster mode, or fp32 eager if refused.

    ``handler`` must be fp32 eager (as ``build_handler`` returns it). ``limit`` is the batch cap
    warmup uses (samples or padded tokens); ``sample`` is the config's ``accuracy_sample``,
    prepared; ``report_check`` gets the measured numbers. Runs the mode's compiles, so it belongs
    in warmup, on the thread that loads the model.
    """
    config = handler.config
    plan = mode_for(config, handler.device)
    if not plan.requested:
        return handler
    mode = plan.mode
    batches = check_batches(handler, plan, limit, sample)
    warmup = [b for b in batches if b.kind == "warmup"]
    runner = TorchRunner(handler)
    reference = run_all(runner, batches)
    fp32_seconds = time_batches(runner, warmup) if plan.min_speedup > 0 else None
    original = _Original(
        handler.eager_module(),
        handler.compute_dtype,
        _Snapshot.take(handler.eager_module(), handler.device.type == "cuda")
        if plan.casts_weights
        else None,
    )
    started = time.perf_counter()
    speed: SpeedReport | None = None
    try:
        path = _build(handler, plan, len(warmup))
        candidate = run_all(runner, batches)
        if plan.cuda_graphs and path is not None:
            _capture_graphs(handler, path, batches)
            candidate = run_all(runner, batches)
        report = compare(reference, candidate)
        seconds = time.perf_counter() - started  # built, compiled and checked; timing excluded
        problems = report.problems(plan.tolerance, plan.min_cosine, plan.min_match_rate)
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
            first_line(exc),
        )
        logger.debug("model %s: speed mode %s failure", config.name, mode, exc_info=True)
        return handler
    if report_check is not None:
        report_check(SpeedCheck(config.name, mode, report, speed))
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
