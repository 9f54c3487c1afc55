"""What the serving core refuses a request for; each transport maps them to its own status codes."""

from __future__ import annotations

import asyncio

from nograd.batching import BatcherClosed, DeadlineExceeded, QueueFull, SampleTooLarge


class ModelNotFound(Exception):
    """No model (or version) of that name is in the repository."""


class ModelNotReady(Exception):
    """The model exists but is loading, failed to load, or is draining."""


class InvalidInput(Exception):
    """The request does not match the model's declared inputs; the message says how."""


class LimitExceeded(Exception):
    """The request is well formed but over a configured limit (rows, text length)."""


class InferenceFailed(Exception):
    """The model raised on this request (after bisection, on this request alone)."""


class Overloaded(QueueFull):
    """The server process already holds its most requests in flight (``max_requests_in_flight``):
    refused before its body is read, so overload costs neither memory nor decoding."""

    reason = "in_flight"


class Draining(ModelNotReady):
    """The server received SIGTERM and finishes accepted work only."""


def rejection_reason(exc: BaseException) -> str | None:
    """The ``reason`` label of a request refused before (or instead of) compute."""
    if isinstance(exc, QueueFull):
        return exc.reason
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, (Draining, BatcherClosed)):
        return "draining"
    if isinstance(exc, (LimitExceeded, SampleTooLarge)):
        return "too_large"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return None
