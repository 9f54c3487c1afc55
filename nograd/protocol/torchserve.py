"""TorchServe's wire format, as its handlers and clients see it: a request's body (or each field of
a multipart form) decoded by its content type into the dict a handler reads, and TorchServe's JSON
error body (answers are encoded in ``nograd.core.handler_messages``).

TorchServe's frontend hands each request to the handler as one dict: ``body`` for a raw body, one
key per field of a form; a JSON value parsed, ``text/*`` as a string, anything else as a
``bytearray`` (``ts/protocol/otf_message_handler.py``).
"""

from __future__ import annotations

import json
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from urllib.parse import parse_qsl

from nograd.core.errors import DecodeError
from nograd.core.handler_messages import RAW_FIELD, decode_value


def request_data(
    body: bytes | bytearray, content_type: str, query: dict[str, str]
) -> dict[str, object]:
    """The handler's dict for one request: each field of a multipart form by name, else the raw
    body as ``body``; query parameters too, as TorchServe adds them. A form that cannot be parsed
    is a ``DecodeError``."""
    data: dict[str, object] = {key: value for key, value in query.items()}
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        data.update(_form_fields(body, content_type))
    elif media == "application/x-www-form-urlencoded":
        data.update(parse_qsl(body.decode("latin-1"), keep_blank_values=True))
    else:
        data[RAW_FIELD] = decode_value(body, content_type or "application/octet-stream")
    return data


def _form_fields(body: bytes | bytearray, content_type: str) -> dict[str, object]:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise DecodeError("multipart/form-data body has no parts (is the boundary right?)")
    fields: dict[str, object] = {}
    for part in message.iter_parts():
        assert isinstance(part, Message)
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise DecodeError("a part of the multipart form has no name")
        payload = part.get_payload(decode=True)
        raw = payload if isinstance(payload, bytes) else b""
        fields[name] = decode_value(raw, part.get_content_type() if "content-type" in part else "")
    if not fields:
        raise DecodeError("multipart/form-data body has no fields")
    return fields


def error_body(status: int, kind: str, message: str) -> bytes:
    """TorchServe's error body: ``{"code": 404, "type": "ModelNotFoundException", ...}``."""
    return json.dumps({"code": status, "type": kind, "message": message}, indent=2).encode()
