"""How a failure reaches a gRPC client: its kind's status code, and a message fit for the
client (server paths cut, internals hidden)."""

from __future__ import annotations

import re
from typing import Final

from nograd.grpc.rpc import Code
from nograd.serving.errors import HandlerFailed, InferenceFailed, Kind

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

_ABSOLUTE_PATH: Final = re.compile(r"(?<![\w.:/~-])/(?:[^\s'\"/]+/)+([^\s'\"/]*)")
"""A path from the server's file system (two parts at least: ``/srv/models/x``), not a URL's."""


def client_message(exc: BaseException, kind: Kind) -> str:
    """What a client is told of a failure. nograd's own messages say what was wrong, but one may
    carry a detail from below (a load error's file): absolute server paths are cut to their
    last part. A failure of the model or of nograd itself says only that; its exception and
    traceback are in the log. A TorchServe handler's failure answer is the model's message to
    its client, passed on as HTTP does."""
    if kind is Kind.FAILED and not isinstance(exc, HandlerFailed):
        if isinstance(exc, InferenceFailed):
            return "the model failed on this request (the server's log has the detail)"
        return "internal error (the server's log has the detail)"
    return _ABSOLUTE_PATH.sub(lambda found: ".../" + found[1], str(exc))
