"""Model configuration files (``models/<name>/config.toml`` or ``config.yaml``).

A malformed config must fail loudly at startup with the file and the field named, because a model
that silently loads with a wrong shape or batch size is worse than one that does not load.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]
Precision = Literal["fp32", "bf16", "fp16"]
CONFIG_NAMES = ("config.toml", "config.yaml", "config.yml")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ConfigError(Exception):
    """A model config that cannot be used; the message names the file and the field."""


class TensorSpec(BaseModel):
    """One input or output, per sample: the batch dimension is implicit and not listed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: tuple[int, ...]
    """Per-sample shape; -1 marks a variable dimension (padded when batched)."""

    @field_validator("shape")
    @classmethod
    def _dims_valid(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        for dim in shape:
            if dim == 0 or dim < -1:
                raise ValueError(f"dimension {dim} in shape {list(shape)} must be positive or -1")
        return shape


class ModelConfig(BaseModel):
    """What nograd needs to serve one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str = "1"
    platform: str = "pytorch"
    module: str = "model.py"
    """Python file, inside the model folder, that builds the model."""
    weights: str | None = "model.safetensors"
    """Weights file inside the model folder: .safetensors, or .pt/.pth read with weights_only.
    Empty (``weights = ""``; TOML has no null) when the model's ``build_handler`` loads its own."""
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    max_batch_size: int | None = Field(default=None, ge=1, le=65536)
    max_queue_delay_ms: float | None = Field(default=None, ge=0.0, le=10_000.0)
    max_queue_size: int | None = Field(default=None, ge=1)
    device: str = "auto"
    precision: Precision = "fp32"
    batch_unit: Literal["samples", "tokens"] = "samples"
    """Unit of the batch limit: samples, or padded tokens for sequence models."""
    max_batch_tokens: int | None = Field(default=None, ge=1)
    """Cap on padded tokens per batch for token-unit models."""

    @field_validator("name")
    @classmethod
    def _name_valid(cls, name: str) -> str:
        if not _NAME_RE.match(name):
            raise ValueError(f"model name {name!r} must match {_NAME_RE.pattern}")
        return name

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) else value

    @field_validator("device")
    @classmethod
    def _device_valid(cls, device: str) -> str:
        if not _DEVICE_RE.match(device):
            raise ValueError(f"device {device!r} must be cpu, cuda, cuda:N or auto")
        return device

    @field_validator("weights", mode="before")
    @classmethod
    def _empty_weights_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("module", "weights")
    @classmethod
    def _inside_folder(cls, value: str | None) -> str | None:
        if value is not None and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError(f"path {value!r} must be relative and stay inside the model folder")
        return value

    @model_validator(mode="after")
    def _names_unique(self) -> ModelConfig:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [spec.name for spec in specs]
            if len(names) != len(set(names)):
                raise ValueError(f"{kind} names must be unique, got {names}")
        return self


def find_config(model_dir: Path) -> Path | None:
    """The config file of a model folder, or None when the folder holds no model."""
    for name in CONFIG_NAMES:
        candidate = model_dir / name
        if candidate.is_file():
            return candidate
    return None


def load_config(path: Path) -> ModelConfig:
    """Parse and validate one config file; every error names ``path`` and the field."""
    try:
        text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a table of settings at the top level")
    raw.setdefault("name", path.parent.name)
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}"
            + (f" (got {err['input']!r})" if err["type"] != "missing" else "")
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from exc
