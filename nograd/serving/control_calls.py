"""The parameters of load and unload calls (Triton's model repository extension), read the same
way from HTTP bodies and gRPC messages."""

from __future__ import annotations

import json
from collections.abc import Mapping

from nograd.serving.control import ModelControl
from nograd.serving.errors import InvalidInput, LoadFailed, ModelNotFound
from nograd.serving.repository import Override


async def load_model(control: ModelControl, name: str, parameters: Mapping[str, object]) -> None:
    """A load call from either front; its failures begin as Triton's do, ``failed to load 'm',``
    (Triton's clients and examples match on it), nograd's reason following."""
    try:
        await control.load(name, load_parameters(parameters))
    except (InvalidInput, LoadFailed, ModelNotFound) as exc:
        raise type(exc)(f"failed to load '{name}', {exc}") from exc


def load_parameters(parameters: Mapping[str, object]) -> Override | None:
    """The config override of a load call's parameters (Triton's: ``config``, a JSON object of
    config fields as text); a ``file:`` parameter or anything else is refused by name. Which
    fields an override may name is ``check_override``'s rule, applied wherever one is read."""
    override: Override | None = None
    for key, value in parameters.items():
        if key == "config":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidInput(f"parameter 'config' is not JSON: {exc}") from exc
            if not isinstance(value, dict):
                raise InvalidInput(
                    "parameter 'config' must be a JSON object of model config fields, such as "
                    '{"max_batch_size": 8}'
                )
            override = value
        elif key.startswith("file:"):
            raise InvalidInput(
                f"parameter {key!r}: model files cannot be uploaded; put them in the model "
                "repository and load the model by name"
            )
        elif key != "unload_dependents":
            raise InvalidInput(f"unknown load parameter {key!r} (known: config)")
    return override


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
