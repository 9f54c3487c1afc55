"""TorchServe's ``ts.utils.util``: the helpers handlers use, with TorchServe's behaviour."""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
from types import ModuleType
from typing import Any

import yaml

logger = logging.getLogger(__name__)


class PredictionException(Exception):
    """Raised by a handler to answer every request of its batch with ``error_code``."""

    def __init__(self, message: str, error_code: int = 500) -> None:
        self.message = message
        self.error_code = error_code
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"


def list_classes_from_module(module: ModuleType, parent_class: type | None = None) -> list[type]:
    """The classes defined in ``module`` itself (not imported into it), as TorchServe finds a
    handler's or a model file's one class."""
    classes = [
        member
        for _, member in inspect.getmembers(
            module, lambda m: inspect.isclass(m) and m.__module__ == module.__name__
        )
    ]
    if parent_class is not None:
        return [c for c in classes if issubclass(c, parent_class)]
    return classes


def load_label_mapping(mapping_file_path: str) -> dict[str, Any] | None:
    """``index_to_name.json`` as a dict of class index (text) to name; None when absent. A
    label given as a list (ImageNet's ``["n01440764", "tench"]``) is its last item."""
    if not os.path.isfile(mapping_file_path):
        logger.warning(
            "%r is missing. Inference output will not include class name.", mapping_file_path
        )
        return None
    with open(mapping_file_path) as file:
        mapping = json.load(file)
    if not isinstance(mapping, dict):
        raise Exception('index->name JSON mapping should be in "class": "label" format.')
    if "object_type_names" in mapping and isinstance(mapping["object_type_names"], list):
        return {str(k): v for k, v in enumerate(mapping["object_type_names"])}
    for key, value in mapping.items():
        label = value[-1] if isinstance(value, list) and value else value
        if not isinstance(label, str):
            raise Exception("labels in index->name mapping must be either str or List[str]")
        mapping[key] = label
    return mapping


def map_class_to_label(
    probs: list[Any], mapping: dict[str, Any] | None = None, lbl_classes: Any = None
) -> list[dict[str, Any]]:
    """Per row, ``{label: probability}`` for the given classes, as TorchServe maps them."""
    if not isinstance(probs, list):
        raise Exception("Convert classes to list before doing mapping")
    if mapping is not None and not isinstance(mapping, dict):
        raise Exception("Mapping must be a dict")
    if lbl_classes is None:
        lbl_classes = itertools.repeat(range(len(probs[0])), len(probs))
    return [
        {
            (mapping[str(lbl_class)] if mapping is not None else str(lbl_class)): prob
            for lbl_class, prob in zip(*row, strict=False)
        }
        for row in zip(lbl_classes, probs, strict=False)
    ]


def get_yaml_config(yaml_file_path: str) -> dict[str, Any]:
    with open(yaml_file_path) as file:
        config: dict[str, Any] = yaml.safe_load(file) or {}
    return config
