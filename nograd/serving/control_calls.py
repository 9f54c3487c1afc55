"""The parameters of load and unload calls (Triton's model repository extension), read the same
way from HTTP bodies and gRPC messages."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import NamedTuple

from nograd.schema.config import check_model_name
from nograd.serving.control import ModelControl
from nograd.serving.errors import InvalidInput, LoadFailed, ModelNotFound, PollFailed
from nograd.serving.repository import Override
from nograd.serving.uploads import FILE_PREFIX, Upload, file_content


async def load_model(control: ModelControl, name: str, parameters: Mapping[str, object]) -> None:
    """A load call from either front; its failures begin as Triton's do, ``failed to load 'm',``
    (Triton's clients and examples match on it), nograd's reason following. A call with model
    files serves them in place of the repository's folder; one without reverts to it, as in
    Triton."""
    try:
        try:
            check_model_name(name)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        override, upload = load_parameters(parameters)
        if upload is None:
            control.uploads.remove(name)
        else:
            control.uploads.write(name, upload)
        await control.load(name, override)
    except PollFailed as exc:
        raise PollFailed(
            f"failed to load '{name}', failed to poll from model repository: {exc}"
        ) from exc
    except (InvalidInput, LoadFailed, ModelNotFound) as exc:
        raise type(exc)(f"failed to load '{name}', {exc}") from exc


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
    if files:
        text = config if isinstance(config, str | None) else json.dumps(config)
        return LoadParameters(None, Upload(text, files))
    if config is None:
        return LoadParameters(None, None)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise InvalidInput(f"parameter 'config' is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidInput(
            "parameter 'config' must be a JSON object of model config fields, such as "
            '{"max_batch_size": 8}'
        )
    return LoadParameters(config, None)


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
