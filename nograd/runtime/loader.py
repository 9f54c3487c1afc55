"""Loading a model folder safely: its code from inside the repository, weights without pickle."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Protocol, cast

import torch
from safetensors.torch import load_file

from nograd.formats.table import serving_format
from nograd.runtime.engines.artifacts import verify_sha256
from nograd.runtime.engines.autocomplete import auto_complete
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.onnx import OnnxPath
from nograd.runtime.engines.registry import open_engine
from nograd.runtime.engines.signature import with_signature
from nograd.runtime.engines.torchscript import ScriptedForward, TorchScriptPath
from nograd.runtime.handler import ModelHandler
from nograd.runtime.runners import Handler
from nograd.runtime.shapes import ShapedHandler, needs_shaping
from nograd.runtime.string_tensors import StringTensorHandler, has_strings
from nograd.schema.config import ModelConfig, chooses_engine

logger = logging.getLogger(__name__)


class LoadError(Exception):
    """A model that cannot be served; the message says which file and why."""


class FormatRunner(Protocol):
    """What a format's ``runner`` names: the handler of one of its models, loaded on ``device``;
    ``LoadError`` says which file and why it cannot be served."""

    def __call__(
        self, repository: Path, model_dir: Path, config: ModelConfig, device: torch.device
    ) -> Handler: ...


def inside(root: Path, path: Path) -> Path:
    """Resolve ``path`` and refuse it when it leaves ``root`` (symlinks included)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise LoadError(f"{path} resolves outside the model repository {root}")
    return resolved


def locate(model_dir: Path, relative: str) -> Path:
    """A file of the model: in its folder, or, for a numbered version folder, in the model's
    folder above it (code shared by every version, weights per version)."""
    path = model_dir / relative
    if not path.exists() and model_dir.name.isdigit() and (model_dir.parent / relative).exists():
        return model_dir.parent / relative
    return path


def module_name(config: ModelConfig) -> str:
    """The private name a version's code is imported under: one per version, as two versions of
    a model may be loaded at once."""
    return f"nograd_models.{config.name}.v{config.version}"


def import_model_module(repository: Path, model_dir: Path, config: ModelConfig) -> ModuleType:
    """Import the model's code by file path under a private name, never from the network."""
    path = inside(repository, locate(model_dir, config.module))
    if not path.is_file():
        raise LoadError(f"{path}: model code not found (field 'module')")
    name = module_name(config)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"{path}: cannot import")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise LoadError(f"{path}: import failed: {exc}") from exc
    return module


def forget_module(module: ModuleType) -> None:
    """Take an unloaded version's code out of ``sys.modules``, where it would keep the module,
    its classes and whatever it holds at module level alive after the version is gone; only
    while the entry is still that module, since a reload of the same version imports its new
    code under the same name before the old one is freed."""
    name = module.__name__
    if sys.modules.get(name) is module:
        del sys.modules[name]


def load_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Safetensors, or a torch checkpoint read with ``weights_only=True``: never plain pickle."""
    if not path.is_file():
        raise LoadError(f"{path}: weights file not found (field 'weights')")
    if path.suffix == ".safetensors":
        return load_file(str(path), device=str(device))
    if path.suffix in (".pt", ".pth", ".bin"):
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except Exception as exc:
            raise LoadError(f"{path}: not a weights-only checkpoint: {exc}") from exc
        if not isinstance(state, dict):
            raise LoadError(f"{path}: expected a state dict, got {type(state).__name__}")
        return cast(dict[str, torch.Tensor], state)
    raise LoadError(f"{path}: weights must be .safetensors, .pt or .pth")


def build_handler(
    repository: Path, model_dir: Path, config: ModelConfig, device: torch.device
) -> Handler:
    """The handler of the model ``config`` describes, built by the runner of the format that
    read it (``nograd.formats.table``): the runtime names no format."""
    return _runner(serving_format(config).runner)(repository, model_dir, config, device)


@functools.cache
def _runner(row: str) -> FormatRunner:
    """The function a format's ``runner`` names (``module:function``), imported on first use."""
    module_name, _, attribute = row.partition(":")
    return cast(FormatRunner, getattr(importlib.import_module(module_name), attribute))


def build_artifact_handler(
    repository: Path, model_dir: Path, config: ModelConfig, device: torch.device
) -> Handler:
    """The artifact, checked against ``artifact_sha256`` and opened by its engine; the handler
    is the model code's ``build_handler(..., engine=...)`` when ``module`` exists (its pre- and
    post-processing), else the default one, with no eager module: the engine holds the weights
    and runs every batch. The config's missing inputs and outputs are read from the artifact."""
    assert config.artifact is not None  # the config refuses an artifact format without one
    path = inside(repository, locate(model_dir, config.artifact))
    if not path.is_file():
        raise LoadError(f"{path}: artifact not found (field 'artifact')")
    try:
        verify_sha256(path, config.artifact_sha256)
        if config.batch_dimension is None:
            config = auto_complete(config, path)
        config = with_signature(config, path)
        engine = open_engine(config.format, path, device)
    except ArtifactError as exc:
        raise LoadError(str(exc)) from exc
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise LoadError(
            f"{path}: cannot load the {config.format} artifact: {type(exc).__name__}: "
            f"{first[0] if first else ''}"
        ) from exc
    code_path = locate(model_dir, config.module)
    if code_path.is_file():
        code = import_model_module(repository, model_dir, config)
        factory = getattr(code, "build_handler", None)
        if factory is None or "engine" not in inspect.signature(factory).parameters:
            raise LoadError(
                f"{code_path}: with format {config.format!r} the model code only supplies the "
                "handler: define build_handler(model_dir, config, device, engine)"
            )
        handler = cast(ModelHandler, factory(model_dir, config, device, engine=engine))
    elif has_strings(config):
        # No handler of its own turns its strings into tensors (a tokenizer): the model reads
        # them itself.
        return _string_handler(path, engine, config, device)
    elif needs_shaping(config):
        handler = ShapedHandler(None, config, device)
    else:
        handler = ModelHandler(None, config, device)
    try:
        engine.check_inputs(handler)
    except ArtifactError as exc:
        raise LoadError(f"{path}: {exc}") from exc
    if chooses_engine(config) and isinstance(engine, TorchScriptPath):
        # Opted in to nograd's engine choice: the TorchScript module is the eager forward the
        # engines are built from and checked against (nograd/runtime/engines/choice.py).
        handler.module = ScriptedForward(engine, handler)
        return handler
    handler.speed_path = engine
    handler.speed_mode = config.format
    return handler


def _string_handler(
    path: Path, engine: object, config: ModelConfig, device: torch.device
) -> StringTensorHandler:
    """A model with BYTES tensors: ONNX Runtime on numpy arrays, the only engine that takes
    strings (torch holds none)."""
    if not isinstance(engine, OnnxPath):
        raise LoadError(
            f"{path}: BYTES (TYPE_STRING) tensors are served through ONNX Runtime only; a "
            f"{config.format} model's tensors pass through torch, which holds no strings"
        )
    try:
        return StringTensorHandler(engine, config, device)
    except ArtifactError as exc:
        raise LoadError(f"{path}: {exc}") from exc
