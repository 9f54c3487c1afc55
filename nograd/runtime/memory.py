"""Measured memory costs and per-device batch budgets.

The dynamic batcher must never grow a batch past what the device can hold, and guessing the
activation cost of an arbitrary model from its parameters is unreliable (attention, fused
kernels, dtype promotion...).  Instead each model's forward is *measured* at a few batch
shapes, a small cost model is fitted to those measurements, and the batcher sizes batches
from that model against a budget carved out of the device's free memory.

Everything here takes plain arguments so it can be tested and reused without the HTTP layer
or the settings object.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol, Self, runtime_checkable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nograd.host.readings import HostMemory

__all__ = [
    "UNBOUNDED_ROWS",
    "CheckPoint",
    "CostModel",
    "CpuMemoryProbe",
    "CudaMemoryProbe",
    "LiveTensorTracker",
    "MemoryProbe",
    "PlanRow",
    "Profile",
    "batch_limit",
    "device_budget",
    "fit_cost_model",
    "format_bytes",
    "format_plan",
    "is_out_of_memory",
    "probe_for",
    "profile_forward",
    "share_budget",
]

# A point measured by the profiler: (rows, padded length, peak extra bytes).
Point = tuple[int, int, int]

# Returned by CostModel.max_rows when memory does not bound the batch at all.
UNBOUNDED_ROWS: Final = 1 << 62

_CPU_OOM_MESSAGES: Final = (
    "DefaultCPUAllocator: can't allocate memory",
    "not enough memory",
)


# --------------------------------------------------------------------------------------------
# Live tensor tracking (the CPU probe)
# --------------------------------------------------------------------------------------------


# torch leaves TorchDispatchMode untyped, hence the no-untyped-call ignores below.
class LiveTensorTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts bytes of tensor storages created while active, with their live peak.

    Process RSS is useless for sizing CPU batches: the allocator keeps freed pages, other
    threads allocate concurrently and the number is noisy at the scale of one activation.
    Intercepting every ATen op instead gives an exact, deterministic account of the tensor
    storages a forward creates and how long each one lives.

    Only storages *created* by ops while the mode is active are counted: an output whose
    storage is also one of the op's inputs (views of weights, in-place ops, ``out=``) belongs
    to someone else.  Views share their base's storage, so counting per storage counts every
    buffer once.  Storages are released through ``weakref.finalize`` so ``current_bytes``
    falls as soon as Python drops the last tensor referencing a buffer, even after the mode
    has exited.

    Limitations worth knowing when reading the numbers: scratch buffers a kernel allocates
    and frees internally (oneDNN/BLAS workspaces) are invisible, as are ops run on other
    threads, since dispatch modes are thread-local.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.current_bytes = 0
        self.peak_bytes = 0
        # Finalizers can run on any thread and, via GC, re-enter while we hold the lock.
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}

    def __enter__(self) -> Self:
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]

    @property
    def live_storages(self) -> int:
        """Number of tracked storages still alive; lets tests prove nothing leaked."""
        with self._lock:
            return len(self._live)

    def reset_peak(self) -> None:
        """Starts a new peak window without forgetting what is still alive."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        input_storages: set[int] | None = None
        for leaf in tree_leaves(out):
            storage = self._storage_of(leaf)
            if storage is None:
                continue
            key = id(storage)
            with self._lock:
                if key in self._live:
                    # Seen before: only its size can have changed (resize_, out= growth).
                    self._set_size(key, storage.nbytes())
                    continue
            if input_storages is None:
                inputs = map(self._storage_of, tree_leaves((args, kwargs)))
                input_storages = {id(s) for s in inputs if s is not None}
            if key not in input_storages:
                self._track(storage)
        return out

    def _storage_of(self, leaf: object) -> torch.UntypedStorage | None:
        if not (
            isinstance(leaf, torch.Tensor)
            and leaf.device.type == self.device_type
            and leaf.layout == torch.strided
        ):
            return None
        try:
            return leaf.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Storage-less tensor subclasses: nothing we could attribute bytes to.
            return None

    def _track(self, storage: torch.UntypedStorage) -> None:
        # id() is a stable key: torch preserves one Python object per live storage, and the
        # finalizer removes the key before the id can be reused.
        key = id(storage)
        with self._lock:
            self._live[key] = 0
            self._set_size(key, storage.nbytes())
        finalizer = weakref.finalize(storage, self._release, key)
        finalizer.atexit = False

    def _set_size(self, key: int, nbytes: int) -> None:
        self.current_bytes += nbytes - self._live[key]
        self._live[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(key, 0)


# --------------------------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------------------------


@runtime_checkable
class MemoryProbe(Protocol):
    """What the planner needs to know about one device, whatever its kind."""

    @property
    def device(self) -> str:
        """Device label used in logs and metrics, e.g. ``"cpu"`` or ``"cuda:0"``."""
        ...

    def total_bytes(self) -> int:
        """Capacity of the device as this process may use it."""
        ...

    def available_bytes(self) -> int:
        """Memory this process could still allocate right now."""
        ...

    def allocated_bytes(self) -> int:
        """Memory currently held by this process on the device (for metrics)."""
        ...

    def measure_peak(self, fn: Callable[[], object]) -> int:
        """Peak extra bytes held while ``fn`` runs; its result is freed before returning."""
        ...

    def release_cache(self) -> None:
        """Hands cached-but-unused memory back so availability reads are meaningful."""
        ...


class CpuMemoryProbe(HostMemory):
    """Host memory probe; peaks come from :class:`LiveTensorTracker`, not from RSS."""

    device = "cpu"

    def measure_peak(self, fn: Callable[[], object]) -> int:
        with LiveTensorTracker("cpu") as tracker:
            result = fn()
        del result
        return tracker.peak_bytes

    def release_cache(self) -> None:
        """Nothing to do: the CPU allocator returns memory to the system itself."""


class CudaMemoryProbe:
    """CUDA probe built on the caching allocator's own counters.

    ``max_memory_allocated`` is exact for everything routed through the caching allocator
    (which is all tensor memory and, in current torch, cuBLAS/cuDNN workspaces), so unlike
    the CPU side no op interception is needed.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaMemoryProbe needs a cuda device, got {device}")
        self.torch_device = device
        self.device = str(device)

    def total_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.torch_device).total_memory)

    def available_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.torch_device)
        # Blocks cached by our allocator look "used" to the driver but are ours to reuse;
        # without adding them back, profiling right before planning shrinks every budget.
        cached = self.reserved_bytes() - self.allocated_bytes()
        return int(free) + max(0, cached)

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.torch_device))

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.torch_device))

    def peak_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def measure_peak(self, fn: Callable[[], object]) -> int:
        # Kernels are asynchronous: synchronise so frees/allocations from earlier work are
        # settled before the baseline and the forward's own work is finished before reading.
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        baseline = self.allocated_bytes()
        result = fn()
        torch.cuda.synchronize(self.torch_device)
        peak = self.peak_allocated_bytes() - baseline
        del result
        return max(0, peak)

    def release_cache(self) -> None:
        torch.cuda.empty_cache()


def probe_for(device: torch.device) -> MemoryProbe:
    """Picks the probe for a device; unsupported kinds fail loudly rather than guess."""
    if device.type == "cpu":
        return CpuMemoryProbe()
    if device.type == "cuda":
        return CudaMemoryProbe(device)
    raise ValueError(f"no memory probe for device type {device.type!r}")


# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Peak extra bytes of one forward as a function of the batch shape.

    ``bytes = fixed + per_unit * (rows * length) + quadratic * (rows * length**2)``.

    For plain models ``length`` is 1, so ``per_unit`` is bytes per sample.  For sequence
    models ``rows * length`` is the padded token count, ``per_unit`` is bytes per token, and
    the quadratic term captures attention-like score matrices (``rows * L * L``).
    """

    fixed: float
    per_unit: float
    quadratic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed", "per_unit", "quadratic"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    def per_row(self, length: int = 1) -> float:
        """Marginal bytes of one more row at this padded length."""
        _check_length(length)
        return self.per_unit * length + self.quadratic * length * length

    def predict(self, rows: int, length: int = 1) -> float:
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        return self.fixed + rows * self.per_row(length)

    def max_rows(self, budget_bytes: float, length: int = 1) -> int:
        """Largest row count whose predicted peak fits the budget; 0 if not even one row.

        A model with no per-row cost is bounded only by the caller's max batch size, so it
        reports :data:`UNBOUNDED_ROWS` rather than infinity (callers take a min).
        """
        slope = self.per_row(length)
        if math.isnan(budget_bytes) or self.predict(1, length) > budget_bytes:
            return 0
        if slope <= 0 or math.isinf(budget_bytes):
            return UNBOUNDED_ROWS
        rows = max(1, math.floor((budget_bytes - self.fixed) / slope))
        if rows > 2**52:
            # Beyond float precision "exact" is meaningless, and no batch is this large.
            return min(rows, UNBOUNDED_ROWS)
        # Float division can land one off either way at exact boundaries; settle it exactly.
        while rows > 1 and self.predict(rows, length) > budget_bytes:
            rows -= 1
        while self.predict(rows + 1, length) <= budget_bytes:
            rows += 1
        return rows

    def max_tokens(self, budget_bytes: float, length: int) -> int:
        """Padded token capacity at this length: what a sequence batcher actually packs."""
        return self.max_rows(budget_bytes, length) * length


def _check_length(length: int) -> None:
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")


def fit_cost_model(points: Sequence[Point], quadratic: bool) -> CostModel:
    """Least-squares fit of :class:`CostModel` with non-negative coefficients.

    Negative coefficients are physically meaningless and would make ``max_rows`` blow up, so
    the fit is an exact NNLS: with at most three columns, every subset of columns is solved
    by plain least squares and the best feasible (all >= 0) solution wins.
    """
    if not points:
        raise ValueError("need at least one measured point")
    rows = np.array([p[0] for p in points], dtype=np.float64)
    lengths = np.array([p[1] for p in points], dtype=np.float64)
    measured = np.array([p[2] for p in points], dtype=np.float64)
    if (rows < 1).any() or (lengths < 1).any():
        raise ValueError("rows and lengths must be >= 1")

    columns = [np.ones_like(rows), rows * lengths]
    if quadratic:
        columns.append(rows * lengths * lengths)
    design = np.stack(columns, axis=1)
    # Columns differ by orders of magnitude (1 vs n*L*L); scale them for a well-posed solve.
    scale = np.abs(design).max(axis=0)
    scaled = design / scale
    if np.linalg.matrix_rank(scaled) < design.shape[1]:
        hint = " (quadratic fits need at least two lengths)" if quadratic else ""
        raise ValueError(f"points do not determine {design.shape[1]} coefficients{hint}")

    best: tuple[float, np.ndarray] | None = None
    ncols = design.shape[1]
    for size in range(1, ncols + 1):
        for subset in itertools.combinations(range(ncols), size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], measured, rcond=None)
            if (solution < 0).any():
                continue
            coef = np.zeros(ncols)
            coef[cols] = solution
            residual = float(np.sum((scaled @ coef - measured) ** 2))
            if best is None or residual < best[0]:
                best = (residual, coef)
    coef = best[1] / scale if best is not None else np.zeros(ncols)
    return CostModel(
        fixed=float(coef[0]),
        per_unit=float(coef[1]),
        quadratic=float(coef[2]) if quadratic else 0.0,
    )


@dataclass(frozen=True)
class CheckPoint:
    """A shape measured *after* the fit, to show how far the model can be trusted."""

    rows: int
    length: int
    measured_bytes: int
    predicted_bytes: float

    @property
    def relative_error(self) -> float:
        if self.measured_bytes == 0:
            return 0.0 if self.predicted_bytes == 0 else math.inf
        return abs(self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass
class Profile:
    """Everything learned about one model's memory, kept for the startup log and metrics."""

    points: tuple[Point, ...]
    model: CostModel
    check_point: CheckPoint

    @property
    def relative_error(self) -> float:
        return self.check_point.relative_error


def _default_check(rows: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    # Planning extrapolates beyond the profiled grid (up to max batch size), so check there.
    top = max(rows)
    return max(top + 1, top * 3 // 2), max(lengths)


def profile_forward(
    run: Callable[[int, int], object],
    probe: MemoryProbe,
    rows: Sequence[int],
    lengths: Sequence[int] = (1,),
    check: tuple[int, int] | None = None,
    quadratic: bool = False,
) -> Profile:
    """Measures ``run(rows, length)`` over the grid, fits a cost model and validates it.

    ``run`` must build the batch itself (collation buffers are part of the real cost) and
    should run under ``torch.inference_mode()`` like serving does, since autograd would keep
    every activation alive and inflate the numbers.  One unmeasured warm-up call comes first
    so lazily initialised state (workspaces, caches) is not billed to the first shape.
    """
    if not rows or not lengths:
        raise ValueError("rows and lengths must be non-empty")
    if min(rows) < 1 or min(lengths) < 1:
        raise ValueError("rows and lengths must be >= 1")
    grid = [(n, length) for n in rows for length in lengths]
    check_rows, check_length = check if check is not None else _default_check(rows, lengths)
    if (check_rows, check_length) in grid:
        raise ValueError(f"check point {(check_rows, check_length)} is part of the fit grid")

    def measure(n: int, length: int) -> int:
        return probe.measure_peak(lambda: run(n, length))

    warmup = run(min(rows), min(lengths))
    del warmup
    points = tuple((n, length, measure(n, length)) for n, length in grid)
    model = fit_cost_model(points, quadratic=quadratic)
    checkpoint = CheckPoint(
        rows=check_rows,
        length=check_length,
        measured_bytes=measure(check_rows, check_length),
        predicted_bytes=model.predict(check_rows, check_length),
    )
    return Profile(points=points, model=model, check_point=checkpoint)


# --------------------------------------------------------------------------------------------
# Budget planning
# --------------------------------------------------------------------------------------------


def device_budget(probe: MemoryProbe, fraction: float, explicit_bytes: int | None) -> int:
    """Bytes the batcher may spend on activations on one device.

    Call it after every model on the device is loaded: availability then already excludes
    the weights, and the fraction leaves headroom for fragmentation, allocator slack and
    whatever the cost model misses.  An operator-supplied byte count always wins.
    """
    if explicit_bytes is not None:
        if explicit_bytes < 0:
            raise ValueError(f"explicit budget must be >= 0, got {explicit_bytes}")
        return explicit_bytes
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(fraction * probe.available_bytes())


def share_budget(budget: int, models: Mapping[str, float]) -> dict[str, int]:
    """Splits a device budget among its models in proportion to their weights.

    Weights are typically per-row cost times max batch size, so a small model is not handed
    gigabytes it can never use while a large one starves.  Remainders go to the largest
    fractional shares so the split adds up to the budget exactly and never exceeds it.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if any(not math.isfinite(w) or w < 0 for w in models.values()):
        raise ValueError("model weights must be finite and >= 0")
    if not models:
        return {}
    total = sum(models.values())
    weights = dict(models) if total > 0 else dict.fromkeys(models, 1.0)
    total = sum(weights.values())
    exact = {name: budget * w / total for name, w in weights.items()}
    shares = {name: math.floor(value) for name, value in exact.items()}
    leftover = budget - sum(shares.values())
    by_remainder = sorted(exact, key=lambda name: (shares[name] - exact[name], name))
    for name in by_remainder[: max(0, leftover)]:
        shares[name] += 1
    return shares


def batch_limit(model: CostModel, share_bytes: int, max_batch_size: int, length: int = 1) -> int:
    """Rows per batch for a model: its configured cap, lowered to what its share can hold.

    Returns 0 when even a single row does not fit so the caller can reject such requests
    (HTTP 507) instead of silently running them into an out-of-memory error.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return min(max_batch_size, model.max_rows(share_bytes, length))


@dataclass
class PlanRow:
    """One model's line in the startup memory plan."""

    model: str
    device: str
    weights_bytes: int
    per_unit_bytes: float
    limit: int
    budget_bytes: int
    unit: str = "sample"


def format_bytes(value: float) -> str:
    """Binary-prefixed size, compact enough for a fixed-width log table."""
    if not math.isfinite(value):
        return str(value)
    size = float(value)
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or suffix == "TiB":
            return f"{size:.0f} {suffix}" if suffix == "B" else f"{size:.1f} {suffix}"
        size /= 1024
    raise AssertionError("unreachable")


def format_plan(rows: Sequence[PlanRow]) -> str:
    """Fixed-width table so operators can see at a glance why a batch limit is what it is."""
    header = ("model", "device", "weights", "per unit", "limit", "budget")
    body = [
        (
            row.model,
            row.device,
            format_bytes(row.weights_bytes),
            f"{format_bytes(row.per_unit_bytes)}/{row.unit}",
            str(row.limit),
            format_bytes(row.budget_bytes),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    # Text columns read left-aligned, numbers right-aligned.
    align = ["<", "<", ">", ">", ">", ">"]

    def render(line: Sequence[str]) -> str:
        cells = (f"{cell:{a}{w}}" for cell, a, w in zip(line, align, widths, strict=True))
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule, *(render(line) for line in body)])


# --------------------------------------------------------------------------------------------
# Error classification
# --------------------------------------------------------------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether a failure was the device running out of memory.

    OOMs are transient and batch-size dependent (retry smaller, or answer 507), unlike model
    bugs, so they need telling apart.  CPU allocator failures surface as plain RuntimeErrors,
    hence the message match.  Explicit ``raise ... from oom`` chains are followed because
    model wrappers sometimes re-raise with their own exception type.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError):
            message = str(current)
            if any(fragment in message for fragment in _CPU_OOM_MESSAGES):
                return True
        current = current.__cause__
    return False
