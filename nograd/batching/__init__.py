"""Dynamic batching, independent of HTTP and of torch."""

from nograd.batching.batcher import Batcher, BatchObserver, NullObserver, Part, Runner
from nograd.batching.errors import (
    BatcherClosed,
    BatchingError,
    DeadlineExceeded,
    QueueFull,
    SampleTooLarge,
)
from nograd.batching.limit import BatchLimit

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
]
