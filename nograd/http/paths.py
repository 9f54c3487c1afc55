"""The request paths nograd reads itself (ahead of the router, in middlewares), defined once."""

from __future__ import annotations

import re
from typing import Final

from starlette.types import Scope

from nograd.serving.calls.access import LOGGING, MODEL_REPOSITORY, SHARED_MEMORY, TRACE

EMBEDDINGS: Final = "/v1/embeddings"
OPENAI_PREFIX: Final = "/v1/"
TORCHSERVE_PING: Final = "/ping"
TORCHSERVE_PREFIXES: Final = ("/predictions/", "/models")
_PREDICTIONS: Final = re.compile(r"^/predictions/([^/]+)(?:/([^/]+))?/?$")
_V2_MODEL: Final = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(.*)$")
_GROUP_PREFIXES: Final = (
    ("/v2/repository/", MODEL_REPOSITORY),
    ("/v2/systemsharedmemory/", SHARED_MEMORY),
    ("/v2/cudasharedmemory/", SHARED_MEMORY),
    ("/v2/trace/", TRACE),
    ("/models/", MODEL_REPOSITORY),  # TorchServe's management API
)
PLACEMENT: Final = "/nograd/placement"
_GROUP_PATHS: Final = {
    "/v2/logging": LOGGING,
    "/models": MODEL_REPOSITORY,
    PLACEMENT: MODEL_REPOSITORY,  # what the repository index tells, and more
}


def v2_model(path: str) -> tuple[str, str | None, str] | None:
    """(model, version or None, the rest: "/infer", "/ready", "") of a ``/v2/models/...`` path."""
    match = _V2_MODEL.match(path)
    if match is None:
        return None
    return match.group(1), match.group(2), match.group(3) or ""


def infer_target(path: str) -> tuple[str, str | None] | None:
    """(model, version) of a V2 inference path, ``/v2/models/{name}[/versions/{v}]/infer``."""
    parsed = v2_model(path)
    if parsed is None or parsed[2] != "/infer":
        return None
    return parsed[0], parsed[1]


def predictions_target(path: str) -> tuple[str, str | None] | None:
    """(model, version or None) of a TorchServe inference path, ``/predictions/{m}[/{v}]``."""
    match = _PREDICTIONS.match(path)
    return None if match is None else (match.group(1), match.group(2))


def route_path(scope: Scope) -> str:
    """The path the router would match: without the ASGI root path (a proxy's prefix)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def operator_group(path: str) -> str | None:
    """The operator API group (``nograd.serving.calls.access``) a route path belongs to: model
    control and TorchServe's management API, shared memory, trace, logging; None for any other
    path. Generous on purpose: a path of a group's prefix that no route serves is refused
    like the group's routes, never let through."""
    group = _GROUP_PATHS.get(path.rstrip("/") or "/")
    if group is not None:
        return group
    for prefix, group in _GROUP_PREFIXES:
        if path.startswith(prefix):
            return group
    parsed = v2_model(path)
    if parsed is not None and parsed[2].startswith("/trace"):
        return TRACE
    return None
