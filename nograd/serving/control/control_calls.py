"""The parameters of load and unload calls (Triton's model repository extension), read the same
way from HTTP bodies and gRPC messages."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Final, NamedTuple

from nograd.formats.triton.reading.config_json import TOO_DEEP
from nograd.schema.config import check_model_name
from nograd.serving.calls.server_paths import without_server_paths
from nograd.serving.control.model_control import ModelControl
from nograd.serving.control.repository import Override
from nograd.serving.control.uploads import FILE_PREFIX, Upload, UploadsFull, file_content
from nograd.serving.errors import InvalidInput, LoadFailed, ModelNotFound, PollFailed

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES: Final = 64 << 10
"""The longest ``config`` parameter taken: a model config is a few KiB (an ensemble's of a few
hundred steps some tens), and parsing one costs time in every worker at every read, so one past
this is refused before it is parsed."""


async def load_model(control: ModelControl, name: str, parameters: Mapping[str, object]) -> None:
    """A load call from either front; its failures begin as Triton's do, ``failed to load 'm',``
    (Triton's clients and examples match on it), nograd's reason following, with the server's
    own folders left out (the log has them). A call with model files serves them in place of
    the repository's folder; one without reverts to it, as in Triton."""
    try:
        try:
            check_model_name(name)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        override, upload = load_parameters(parameters)
        await _load(control, name, override, upload)
    except PollFailed as exc:
        reason = f"failed to poll from model repository: {exc}"
        raise PollFailed(_client_text(control, name, reason)) from exc
    except (InvalidInput, LoadFailed, ModelNotFound, UploadsFull) as exc:
        raise type(exc)(_client_text(control, name, str(exc))) from exc


async def _load(
    control: ModelControl, name: str, override: Override | None, upload: Upload | None
) -> None:
    """Load ``name``; a call's files are written (off the event loop) into staging first, and
    removed whatever ends the call unless their load serves them."""
    if upload is None:
        await control.load(name, override, files="")
        return
    staged = await asyncio.to_thread(control.uploads.stage, name, upload)
    try:
        await control.load(name, override, files=str(staged))
    finally:
        control.uploads.discard(staged)


def _client_text(control: ModelControl, name: str, reason: str) -> str:
    """A load failure as its client reads it: Triton's beginning, and the reason without the
    server's folders or its code's file and line (logged whole, for the operator)."""
    shown = without_server_paths(reason, control.uploads.server_paths())
    if shown != reason:
        logger.info("load of %s failed: %s", name, reason)
    return f"failed to load '{name}', {shown}"


class LoadParameters(NamedTuple):
    override: Override | None
    upload: Upload | None


def load_parameters(parameters: Mapping[str, object]) -> LoadParameters:
    """A load call's config override (Triton's ``config``: a JSON object of config fields as
    text), or, when it carries ``file:`` parameters, the model it uploads (``config`` is then its
    whole Triton config). Anything else is refused by name. Which fields an override may name
    is ``check_override``'s rule, applied wherever one is read."""
    config: object = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key == "config":
            config = value
        elif key.startswith(FILE_PREFIX):
            files[key] = file_content(key, value)
        elif key != "unload_dependents":
            raise InvalidInput(f"unknown load parameter {key!r} (known: config, file:<path>)")
    if not isinstance(config, str | None):
        try:
            config = json.dumps(config)
        except RecursionError as exc:
            raise InvalidInput(TOO_DEEP) from exc
    if config is not None and len(config) > MAX_CONFIG_BYTES:
        raise InvalidInput(
            f"parameter 'config' is {len(config)} bytes, over the limit of {MAX_CONFIG_BYTES} "
            "bytes of a model config"
        )
    if files:
        return LoadParameters(None, Upload(config, files))
    if config is None:
        return LoadParameters(None, None)
    try:
        document = json.loads(config)
    except RecursionError as exc:
        raise InvalidInput(TOO_DEEP) from exc
    except ValueError as exc:
        raise InvalidInput(f"parameter 'config' is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidInput(
            "parameter 'config' must be a JSON object of model config fields, such as "
            '{"max_batch_size": 8}'
        )
    return LoadParameters(document, None)


def unload_parameters(parameters: Mapping[str, object]) -> bool:
    """Whether an unload call's parameters ask to unload the models an ensemble loaded with it
    (Triton's ``unload_dependents``, false by default)."""
    dependents = False
    for key, value in parameters.items():
        if key != "unload_dependents":
            raise InvalidInput(f"unknown unload parameter {key!r} (known: unload_dependents)")
        if not isinstance(value, bool):
            raise InvalidInput(
                f"parameter 'unload_dependents' must be true or false, got {value!r}"
            )
        dependents = value
    return dependents
