"""Measured memory costs and per-device batch budgets.

The dynamic batcher must never grow a batch past what the device can hold, and guessing the
activation cost of an arbitrary model from its parameters is unreliable (attention, fused
kernels, dtype promotion...). Instead each model's forward is *measured* at a few batch shapes, a
small cost model is fitted to those measurements, and the batcher sizes batches from that model
against a budget carved out of the device's free memory.
"""

from nograd.runtime.memory.budget import (
    batch_limit,
    device_budget,
    share_budget,
)
from nograd.runtime.memory.cost import (
    UNBOUNDED_ROWS,
    CheckPoint,
    CostModel,
    Profile,
    fit_cost_model,
    profile_forward,
)
from nograd.runtime.memory.probes import (
    CpuMemoryProbe,
    CudaMemoryProbe,
    DeviceFreeProbe,
    MemoryProbe,
    ProcessPeakProbe,
    is_out_of_memory,
    probe_for,
)
from nograd.runtime.memory.tracker import LiveTensorTracker

__all__ = [
    "UNBOUNDED_ROWS",
    "CheckPoint",
    "CostModel",
    "CpuMemoryProbe",
    "CudaMemoryProbe",
    "DeviceFreeProbe",
    "LiveTensorTracker",
    "MemoryProbe",
    "ProcessPeakProbe",
    "Profile",
    "batch_limit",
    "device_budget",
    "fit_cost_model",
    "is_out_of_memory",
    "probe_for",
    "profile_forward",
    "share_budget",
]
