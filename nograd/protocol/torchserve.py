"""TorchServe's wire format, as its handlers and clients see it: a prediction's inputs (its raw
body, or each field of a form) decoded by their content types into the dict a handler reads, with
the headers ``context.get_request_header`` answers; and TorchServe's JSON error body (answers are
encoded in ``nograd.core.handler_messages``).

TorchServe's frontend (``InferenceRequestHandler.parseRequest``) makes each prediction a list of
inputs, each with a content type: the raw body the media type of its ``Content-Type``
(parameters cut off), a plain form field none, a file part of a multipart form its own
(``application/octet-stream`` when it gives none); a prediction's query parameters are not
inputs. Its worker (``ts/protocol/otf_message_handler.py``, ``ts/service.py``) hands the
handler one dict per request, an input's value parsed by that content type, and headers where
each input's name maps to ``{"content-type": ...}`` and each request header to its value.
"""

from __future__ import annotations

import json
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Final
from urllib.parse import parse_qsl

from nograd.core.errors import DecodeError
from nograd.core.handler_messages import RAW_FIELD, HandlerRequest, decode_value

FILE_TYPE = "application/octet-stream"
"""The content type Netty gives a multipart file part that names none."""

PREDICTION_HEADERS: Final = {"url_path": "", "explain": "False"}
"""The headers TorchServe's frontend adds to every ``/predictions`` request
(``InferenceRequestHandler.handlePredictions``), over any the client sent."""

Input = tuple[str, bytes | bytearray, str]
"""One input of a request as TorchServe's frontend passes it: name, bytes, content type."""


def handler_request(body: bytes | bytearray, headers: dict[str, str]) -> HandlerRequest:
    """One prediction as TorchServe's handler receives it: each field of a form (multipart or
    URL-encoded) by name, else the raw body as ``body``; each input's headers under its name,
    then the request's headers with ``PREDICTION_HEADERS``. A form that cannot be parsed is a
    ``DecodeError``."""
    content_type = headers.get("content-type", "")
    media = content_type.split(";", 1)[0]
    inputs: list[Input] = []
    if media.strip().lower() == "multipart/form-data":
        inputs += _form_fields(body, content_type)
    elif media.strip().lower() == "application/x-www-form-urlencoded":
        text = bytes(body).decode("utf-8", "replace")
        pairs = parse_qsl(text, keep_blank_values=True)
        inputs += [(key, value.encode("utf-8"), "") for key, value in pairs]
    else:
        inputs.append((RAW_FIELD, body, media))
    data: dict[str, object] = {}
    input_headers: dict[str, object] = {}
    for name, raw, kind in inputs:
        data[name] = decode_value(raw, kind)
        input_headers[name] = {"content-type": kind}
    input_headers.update(headers)
    input_headers.update(PREDICTION_HEADERS)
    return HandlerRequest(data, input_headers)


def _form_fields(body: bytes | bytearray, content_type: str) -> list[Input]:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise DecodeError("multipart/form-data body has no parts (is the boundary right?)")
    fields: list[Input] = []
    for part in message.iter_parts():
        assert isinstance(part, Message)
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise DecodeError("a part of the multipart form has no name")
        payload = part.get_payload(decode=True)
        raw = payload if isinstance(payload, bytes) else b""
        fields.append((name, raw, _part_type(part)))
    if not fields:
        raise DecodeError("multipart/form-data body has no fields")
    return fields


def _part_type(part: Message) -> str:
    """A part's content type as Netty gives it: none for a plain field (no ``filename``), a
    file's media type (parameters cut off), or ``application/octet-stream``."""
    if part.get_param("filename", header="content-disposition") is None:
        return ""
    declared = part.get("content-type")
    if declared is None:
        return FILE_TYPE
    return str(declared).split(";", 1)[0].strip() or FILE_TYPE


def error_body(status: int, kind: str, message: str) -> bytes:
    """TorchServe's error body: ``{"code": 404, "type": "ModelNotFoundException", ...}``."""
    return json.dumps({"code": status, "type": kind, "message": message}, indent=2).encode()
