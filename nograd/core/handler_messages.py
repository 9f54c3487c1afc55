"""What a TorchServe handler is given and answers, one request at a time: shared by the front
that decodes requests (``nograd.protocol.torchserve``) and the runtime that runs the handler.

An answer that is bytes or a string goes out as it is; anything else as JSON with an indent of 2,
as TorchServe's worker encodes it (``ts/protocol/otf_message_handler.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Final

RAW_FIELD: Final = "body"
"""The field a raw (non-form) request body arrives in."""
JSON_TYPE: Final = "application/json"


@dataclass(frozen=True, slots=True)
class HandlerRequest:
    """One request as a TorchServe handler receives it: its fields, and its headers as
    ``context.get_request_header`` reads them (each input's own under its name, as
    ``{"content-type": ...}``, beside the request's)."""

    data: dict[str, object]
    headers: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HandlerAnswer:
    """One request's answer: its bytes, the content type the handler set (TorchServe sends none
    otherwise) and status; or a failure's status and message."""

    body: bytes
    content_type: str | None = None
    status: int = 200
    failed: bool = False


def decode_value(raw: bytes | bytearray, content_type: str) -> object:
    """A value as TorchServe's worker hands it to a handler, by the content type its frontend
    gave the input (a media type without parameters, or ``""``): exactly ``application/json``
    parsed, ``text...`` as str, else bytearray; a JSON or text value that does not decode stays
    bytes, as TorchServe forwards it."""
    if content_type == JSON_TYPE:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            return bytearray(raw)
    if content_type.startswith("text"):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return bytearray(raw)
    return bytearray(raw)


def encode_answer(value: object) -> HandlerAnswer:
    """One handler answer as TorchServe sends it: bytes and str as they are, anything else as
    JSON (indent 2), with no content type unless the handler sets one; a value JSON cannot
    hold is the model's failure."""
    if isinstance(value, bytes | bytearray):
        return HandlerAnswer(bytes(value))
    if isinstance(value, str):
        return HandlerAnswer(value.encode("utf-8"))
    try:
        return HandlerAnswer(json.dumps(value, indent=2).encode("utf-8"))
    except (TypeError, ValueError):
        return failure(503, "Invalid model predict output")


def failure(status: int, message: str) -> HandlerAnswer:
    """A failed prediction: TorchServe answers it with its status and the message."""
    return HandlerAnswer(message.encode("utf-8"), None, status, failed=True)
