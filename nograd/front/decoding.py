"""The V2 inference requests a front process decodes itself, so that the engine process, whose
one event loop serves every front's calls, receives tensors instead of JSON, in a
``DecodedCall`` it serves without ASGI (``nograd.http.decoded``).

Only a request that decodes cleanly takes this way: a small body (``PREDECODED_BODY_BYTES``) that
arrived whole, not compressed, with nothing in shared memory (the engine's regions). Anything
else, a request that fails to decode included, reaches the engine as it came, and the engine
answers it (and its refusal) exactly as a single server does. The engine then takes the same
steps on a decoded request, in the same order, on what the front measured (``nograd.http.v2``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Final

from nograd.bridge.frames import DecodedCall
from nograd.http.connections import STARTED_KEY
from nograd.http.headers import REQUEST_ID_HEADER, TIMEOUT_HEADER, TRACE_PARENT_HEADER
from nograd.http.paths import infer_target, route_path
from nograd.protocol import binary
from nograd.protocol.limits import OFFLOAD_DECODE_BYTES, json_decoded_bytes
from nograd.protocol.v2 import (
    declared_inputs,
    decode_document,
    parse_json,
    split_body,
)
from nograd.protocol.v2_handover import Predecoded

PREDECODED_BODY_BYTES: Final = OFFLOAD_DECODE_BYTES
"""Largest body a front decodes: a larger one's decoding leaves the engine's event loop for a
thread anyway, and its bytes are held in the engine's budget as they arrive."""
HEADER_LENGTH: Final = binary.HEADER_LENGTH.lower().encode("latin-1")
REQUEST_ID, TIMEOUT, TRACE_PARENT = (
    name.lower().encode("latin-1")
    for name in (REQUEST_ID_HEADER, TIMEOUT_HEADER, TRACE_PARENT_HEADER)
)
HEAD_HEADERS: Final = frozenset((REQUEST_ID, TIMEOUT, TRACE_PARENT))
"""The headers of a call's head its lifecycle reads (``nograd.http.exchange.CallHead``)."""


def decodable(scope: MutableMapping[str, Any]) -> tuple[str, str | None] | None:
    """The model (name, version) a call is a V2 inference of, if its headers let its front
    decode it; None else."""
    if scope["method"] != "POST":
        return None
    target = infer_target(route_path(scope))
    if target is None:
        return None
    length = None
    for name, value in scope["headers"]:
        if name == b"content-encoding":
            return None
        if name == b"content-length" and length is None:
            length = value
    if length is None or not length.isdigit() or int(length) > PREDECODED_BODY_BYTES:
        return None
    return target


def decoded_call(
    scope: MutableMapping[str, Any],
    target: tuple[str, str | None],
    length: int,
    predecoded: Predecoded,
) -> DecodedCall:
    """The call the engine serves for a request this front decoded: the header values the
    engine reads (each header's first, as ASGI servers' header lookups give it; every
    ``Authorization``, as the key check reads them)."""
    found: dict[bytes, str] = {}
    authorization: list[bytes] = []
    for name, value in scope["headers"]:
        if name in HEAD_HEADERS and name not in found:
            found[name] = value.decode("latin-1")
        elif name == b"authorization":
            authorization.append(value)
    return DecodedCall(
        scope["path"],
        target[0],
        target[1],
        scope.get("state", {}).get(STARTED_KEY),
        found.get(REQUEST_ID),
        found.get(TIMEOUT),
        found.get(TRACE_PARENT),
        tuple(authorization),
        length,
        predecoded.to_wire(),
    )


def predecode(
    scope: MutableMapping[str, Any], body: bytes, max_decoded_bytes: int
) -> Predecoded | None:
    """The request of a whole ``body``, or None for the engine to decode (and refuse) it."""
    header_length = next((v for k, v in scope["headers"] if k == HEADER_LENGTH), None)
    try:
        header, data = split_body(
            body, None if header_length is None else header_length.decode("latin-1")
        )
        size = json_decoded_bytes(header, max_decoded_bytes)
        if size > max_decoded_bytes:
            return None
        document = parse_json(header)
        declared = declared_inputs(document)
        request = decode_document(document, data)  # no regions: inputs in them fail here
    except Exception:  # any refusal is the engine's to answer, as it always does
        return None
    if any(output.placement is not None for output in request.outputs):
        return None  # written into the engine's regions
    return Predecoded(request, declared, document.get("parameters"), size)
