"""How a failure reaches a gRPC client: its kind's status code, and a message fit for the
client (server paths cut, internals hidden)."""

from __future__ import annotations

import re
from typing import Final

from nograd.grpc.rpc import Code
from nograd.serving.errors import HandlerFailed, InferenceFailed, Kind, ModelAnswered

CODES: Final[dict[Kind, Code]] = {
    Kind.INVALID: Code.INVALID_ARGUMENT,
    Kind.REFUSED: Code.FAILED_PRECONDITION,
    Kind.UNAUTHENTICATED: Code.UNAUTHENTICATED,
    Kind.FORBIDDEN: Code.PERMISSION_DENIED,
    Kind.NOT_FOUND: Code.NOT_FOUND,
    Kind.EXISTS: Code.ALREADY_EXISTS,
    Kind.POLL_FAILED: Code.INTERNAL,
    Kind.UNSUPPORTED: Code.UNIMPLEMENTED,
    Kind.OVER_LIMIT: Code.RESOURCE_EXHAUSTED,
    Kind.CLIENT_GONE: Code.CANCELLED,
    Kind.FAILED: Code.INTERNAL,
    Kind.UNAVAILABLE: Code.UNAVAILABLE,
    Kind.DEADLINE: Code.DEADLINE_EXCEEDED,
    Kind.TOO_LARGE_FOR_MEMORY: Code.RESOURCE_EXHAUSTED,
}
"""Each kind of failure as a gRPC status code."""
ANSWERED_CODES: Final[dict[str, Code]] = {
    "UNKNOWN": Code.UNKNOWN,
    "INTERNAL": Code.INTERNAL,
    "NOT_FOUND": Code.NOT_FOUND,
    "INVALID_ARG": Code.INVALID_ARGUMENT,
    "UNAVAILABLE": Code.UNAVAILABLE,
    "UNSUPPORTED": Code.UNIMPLEMENTED,
    "ALREADY_EXISTS": Code.ALREADY_EXISTS,
    "CANCELLED": Code.CANCELLED,
}
"""A model's own error answer (``ModelAnswered``) by its Triton error code, as Triton's gRPC
front maps the code (``GrpcStatusUtil::CodeToStatus``)."""

_ABSOLUTE_PATH: Final = re.compile(r"(?<![\w.:/~-])/(?:[^\s'\"/]+/)+([^\s'\"/]*)")
"""A path from the server's file system (two parts at least: ``/srv/models/x``), not a URL's."""


def status_code(exc: BaseException, kind: Kind) -> Code:
    """The call's status code: a model's own error answer's by its Triton code, else its
    kind's."""
    if isinstance(exc, ModelAnswered):
        return ANSWERED_CODES.get(exc.code, Code.INTERNAL)
    return CODES[kind]


def client_message(exc: BaseException, kind: Kind) -> str:
    """What a client is told of a failure. nograd's own messages say what was wrong, but one may
    carry a detail from below (a load error's file): absolute server paths are cut to their
    last part. A failure of the model or of nograd itself says only that; its exception and
    traceback are in the log. A TorchServe handler's failure answer, and a Triton model's own
    error answer (``ModelAnswered``), are the model's message to its client, passed on as they
    are, as HTTP does and as Triton does on both."""
    if isinstance(exc, ModelAnswered):
        return str(exc)
    if kind is Kind.FAILED and not isinstance(exc, HandlerFailed):
        if isinstance(exc, InferenceFailed):
            return "the model failed on this request (the server's log has the detail)"
        return "internal error (the server's log has the detail)"
    return _ABSOLUTE_PATH.sub(lambda found: ".../" + found[1], str(exc))
