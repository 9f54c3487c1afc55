"""What the serving core refuses a request for, and the protocol-neutral kind of every failure.

Each failure has one ``Kind``; each front turns kinds into its own status codes (gRPC in one small
table; HTTP answers a kind's ``status``), so a failure means the same thing over every protocol.
"""

from __future__ import annotations

import asyncio
import enum
import math
from typing import Final

# Re-exported: a front names these refusals without importing the batcher.
from nograd.batching import BatcherClosed as BatcherClosed
from nograd.batching import DeadlineExceeded as DeadlineExceeded
from nograd.batching import QueueFull as QueueFull
from nograd.batching import SampleTooLarge as SampleTooLarge
from nograd.core.errors import DecodedTooLarge as DecodedTooLarge
from nograd.core.errors import DecodeError as DecodeError
from nograd.core.errors import ModelAnswered as ModelAnswered


class Kind(enum.Enum):
    """A failure's kind, with the HTTP status it stands for (``status``): what HTTP answers, and
    what metrics and statistics record for every protocol."""

    INVALID = ("invalid", 400)
    """The request is malformed or does not match the model; the message says how."""
    REFUSED = ("refused", 400)
    """A call this server's configuration does not take (model control off), or a load that
    failed: the request was fine, the server's state refuses it."""
    UNAUTHENTICATED = ("unauthenticated", 401)
    FORBIDDEN = ("forbidden", 403)
    """A valid key that does not open this API group (an operator group, Triton's restricted
    APIs): HTTP 403, gRPC PERMISSION_DENIED."""
    NOT_FOUND = ("not_found", 404)
    EXISTS = ("exists", 400)
    POLL_FAILED = ("poll_failed", 500)
    """A load call's model files could not be read or written as sent: Triton's answer ("failed
    to poll from model repository", 500 and INTERNAL), which its clients and tests check for."""
    """A name already taken (a shared-memory region): gRPC's ALREADY_EXISTS, Triton's 400."""
    OVER_LIMIT = ("over_limit", 422)
    """Well formed but over a configured limit (rows, text length, message size)."""
    UNSUPPORTED = ("unsupported", 501)
    """A call Triton answers 501 / UNIMPLEMENTED: a setting it keeps from network changes."""
    CLIENT_GONE = ("client_gone", 499)
    """The client left before its answer (recorded, never sent)."""
    FAILED = ("failed", 500)
    """The model or nograd failed on this request."""
    UNAVAILABLE = ("unavailable", 503)
    """Not ready, draining or overloaded: a transient refusal with a time to retry."""
    DEADLINE = ("deadline", 504)
    TOO_LARGE_FOR_MEMORY = ("too_large_for_memory", 507)
    """One sample does not fit in the device memory the model may use, or a model in the
    memory limit of on-demand residency."""

    @property
    def status(self) -> int:
        status: int = self.value[1]
        return status


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


class HandlerFailed(InferenceFailed):
    """A TorchServe handler answered this request with a failure: its message was written for
    the client (TorchServe sends it as the answer), so every front passes it on."""


class Overloaded(QueueFull):
    """The server process already holds its most requests in flight (``max_requests_in_flight``):
    refused before its body is read, so overload costs neither memory nor decoding."""

    reason = "in_flight"


class BodyBytesOverBudget(QueueFull):
    """The server process already holds its most bytes of request bodies and their decoding
    (``max_body_bytes_in_flight``): refused before the rest of the body is read or decoded."""

    reason = "bytes_in_flight"


class LargerThanLimit(Exception):
    """A model needs more memory than the whole on-demand limit: no eviction makes it fit."""


class LoadTooSlow(QueueFull):
    """The request's deadline is shorter than the expected on-demand load of its model: refused
    at once rather than left to time out, with Retry-After the expected load time (the load
    goes on, so a request then finds the model resident)."""

    reason = "load_too_slow"


class NoRoomNow(ModelNotReady):
    """An on-demand load would fit once requests in flight on other models are answered and
    their grace after their last request (``NOGRAD_EVICTION_GRACE_MS``) has passed."""


class TooManyLoads(QueueFull):
    """As many on-demand loads as a worker takes (``NOGRAD_MAX_PENDING_LOADS``) are under way
    or waiting their turn: refused at once, with Retry-After the time those ahead take."""

    reason = "loads_pending"


class Draining(ModelNotReady):
    """The server received SIGTERM and finishes accepted work only."""


class Unauthenticated(Exception):
    """No valid API key came with the call."""


class Forbidden(Exception):
    """The call's key is valid but does not open the API group it called."""


class ControlRefused(Exception):
    """Load and unload calls are not taken in this model control mode."""


class RegionNotFound(Exception):
    """No shared-memory region of that name is registered."""


class AlreadyExists(Exception):
    """A shared-memory region of that name is already registered."""


class PollFailed(Exception):
    """A load call's model (its uploaded files and config) could not be read as a model folder."""


class Unsupported(Exception):
    """A change this server does not take over the network (a trace or log file's location)."""


class LoadFailed(Exception):
    """A version could not be loaded (or a worker could not apply the call); what served before
    still serves."""


KINDS: Final[tuple[tuple[type[Exception], Kind], ...]] = (
    (DecodedTooLarge, Kind.OVER_LIMIT),
    (DecodeError, Kind.INVALID),
    (InvalidInput, Kind.INVALID),
    (ControlRefused, Kind.REFUSED),
    (LoadFailed, Kind.REFUSED),
    (PollFailed, Kind.POLL_FAILED),
    (Unsupported, Kind.UNSUPPORTED),
    (Unauthenticated, Kind.UNAUTHENTICATED),
    (Forbidden, Kind.FORBIDDEN),
    (ModelNotFound, Kind.NOT_FOUND),
    (RegionNotFound, Kind.NOT_FOUND),
    (AlreadyExists, Kind.EXISTS),
    (LimitExceeded, Kind.OVER_LIMIT),
    (ModelNotReady, Kind.UNAVAILABLE),
    (QueueFull, Kind.UNAVAILABLE),
    (BatcherClosed, Kind.UNAVAILABLE),
    (DeadlineExceeded, Kind.DEADLINE),
    (SampleTooLarge, Kind.TOO_LARGE_FOR_MEMORY),
    (LargerThanLimit, Kind.TOO_LARGE_FOR_MEMORY),
    (InferenceFailed, Kind.FAILED),
)
"""Every failure nograd names, with its kind; anything else is ``FAILED``."""

RETRY_AFTER_S: Final = 1
"""When a transient refusal with no estimate of its own says to come back."""


ANSWERED_KINDS: Final[dict[int, Kind]] = {
    400: Kind.INVALID,
    404: Kind.NOT_FOUND,
    503: Kind.UNAVAILABLE,
}
"""The kind of a model's own error answer (``ModelAnswered``) by its status; any other is
``FAILED`` (HTTP still answers the status it carries)."""


def kind_of(exc: BaseException) -> Kind:
    if isinstance(exc, ModelAnswered):
        return ANSWERED_KINDS.get(exc.status, Kind.FAILED)
    for cause, kind in KINDS:
        if isinstance(exc, cause):
            return kind
    return Kind.FAILED


def is_server_fault(kind: Kind) -> bool:
    """A failure worth a traceback in the log: neither the client's nor a refusal by design."""
    return kind is Kind.FAILED


def retry_after_s(exc: BaseException) -> int:
    """Whole seconds before a refused request is worth sending again: the queue's estimate when
    it has one."""
    if isinstance(exc, QueueFull):
        return max(1, math.ceil(exc.retry_after_s))
    return RETRY_AFTER_S


def rejection_reason(exc: BaseException) -> str | None:
    """The ``reason`` label of a request refused before (or instead of) compute."""
    if isinstance(exc, QueueFull):
        return exc.reason
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, (Draining, BatcherClosed)):
        return "draining"
    if isinstance(exc, (LimitExceeded, SampleTooLarge, DecodedTooLarge)):
        return "too_large"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return None
