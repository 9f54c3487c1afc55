"""Triton model configurations as JSON: printed as Triton's model configuration endpoint prints
them, and read as a load call sends one."""

from __future__ import annotations

import json
from typing import Any, Final

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from nograd.formats.triton.reading.generated import model_config_pb2 as pb


def config_document(message: Message) -> dict[str, Any]:
    """The message as JSON, as Triton's model configuration endpoint prints it: every field,
    64-bit integers as numbers; an ensemble's ``max_inflight_requests`` only when set (Triton
    2.51, whose answers nograd is checked against, does not have the field)."""
    document = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    scheduling = document.get("ensemble_scheduling")
    if scheduling is not None and not int(scheduling.get("max_inflight_requests", 0)):
        scheduling.pop("max_inflight_requests", None)
    return numbers_of(message, document)


def numbers_of(message: Message, document: dict[str, Any]) -> dict[str, Any]:
    """protobuf's JSON writes 64-bit integers as strings; Triton's writer does not."""
    for descriptor in message.DESCRIPTOR.fields:
        key = descriptor.name
        if key not in document:
            continue
        value = getattr(message, key)
        repeated = descriptor.is_repeated
        if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
            if descriptor.message_type.GetOptions().map_entry:
                entries = value
                value_field = descriptor.message_type.fields_by_name["value"]
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    for entry_key, entry in entries.items():
                        numbers_of(entry, document[key][str(entry_key)])
            elif repeated:
                for item, item_document in zip(value, document[key], strict=True):
                    numbers_of(item, item_document)
            else:
                numbers_of(value, document[key])
        elif descriptor.type in _INT64:
            document[key] = [int(v) for v in document[key]] if repeated else int(document[key])
    return document


_INT64: Final = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


TOO_DEEP: Final = "parameter 'config' is nested too deeply to be a model config"


class ConfigTooDeep(ValueError):
    """A config nested deeper than JSON's parser follows: no model config is (Triton's own
    nest a few levels), so it is a malformed request, not a repository to poll."""


def config_text(name: str, document: str) -> str:
    """A load call's Triton config (JSON, as Triton's clients send it) as ``config.pbtxt`` for
    model ``name`` (its name filled in when missing); a ValueError says what is wrong."""
    message = pb.ModelConfig()
    try:
        json.loads(document)
    except RecursionError as exc:
        raise ConfigTooDeep(TOO_DEEP) from exc
    except ValueError as exc:
        raise ValueError(f"invalid config override: {exc}") from exc
    try:
        json_format.Parse(document, message)
    except (ValueError, json_format.ParseError) as exc:
        raise ValueError(f"invalid config override: {exc}") from exc
    if message.name and message.name != name:
        raise ValueError(f"the config's name {message.name!r} differs from the model's {name!r}")
    message.name = name
    text: str = text_format.MessageToString(message)
    return text
