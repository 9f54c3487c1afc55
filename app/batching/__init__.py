"""Dynamic batching, independent of HTTP and of torch."""

from app.batching.batcher import Batcher, BatchObserver, NullObserver, Part, Runner
from app.batching.errors import (
    BatcherClosed,
    BatchingError,
    DeadlineExceeded,
    QueueFull,
    SampleTooLarge,
)
from app.batching.limit import BatchLimit

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
