"""Dynamic batching, independent of HTTP and of torch: the public API other layers import."""

from nograd.batching.batcher import Batcher
from nograd.batching.errors import (
    BatcherClosed,
    BatchingError,
    DeadlineExceeded,
    QueueFull,
    SampleTooLarge,
    WaitTooLong,
)
from nograd.batching.limit import BatchLimit
from nograd.batching.protocols import BatchObserver, NullObserver, Part, Runner

__all__ = [
    "BatchLimit",
    "BatchObserver",
    "Batcher",
    "BatcherClosed",
    "BatchingError",
    "DeadlineExceeded",
    "NullObserver",
    "Part",
    "QueueFull",
    "Runner",
    "SampleTooLarge",
    "WaitTooLong",
]
