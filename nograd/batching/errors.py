"""Why a queued request did not get a result; the API maps each to its HTTP status."""

from __future__ import annotations

import asyncio
from typing import Any


class BatchingError(Exception):
    """Base of every error the batcher hands back to a caller."""


class QueueFull(BatchingError):
    """The model's queue is at ``max_queue_size``: shed load now rather than grow memory."""

    reason = "queue_full"
    """The ``reason`` label of the refusal in ``nograd_rejected_total``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """When coming back is expected to find room."""


class WaitTooLong(QueueFull):
    """The work queued ahead is expected to take longer than the request may wait: refusing it
    now is cheaper for everyone than queueing it to time out."""

    reason = "queue_wait"


class DeadlineExceeded(BatchingError):
    """The request's deadline passed before its batch started."""


class SampleTooLarge(BatchingError):
    """One sample alone does not fit the device memory budget."""


class BatcherClosed(BatchingError):
    """The model is draining or stopped and takes no new work."""


def fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail a caller's future (once); the caller may be gone already, so the exception is marked
    retrieved and asyncio does not warn."""
    if not future.done():
        future.set_exception(exc)
        future.exception()
