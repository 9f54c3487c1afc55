"""Why a queued request did not get a result; the API maps each to its HTTP status."""


class BatchingError(Exception):
    """Base of every error the batcher hands back to a caller."""


class QueueFull(BatchingError):
    """The model's queue is at ``max_queue_size``: shed load now rather than grow memory."""


class DeadlineExceeded(BatchingError):
    """The request's deadline passed before its batch started."""


class SampleTooLarge(BatchingError):
    """One sample alone does not fit the device memory budget."""


class BatcherClosed(BatchingError):
    """The model is draining or stopped and takes no new work."""
