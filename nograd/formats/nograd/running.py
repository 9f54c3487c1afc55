"""What serves a model of nograd's format: its code's torch module with its weights, or an
engine's artifact (with the handler its code may supply)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

import torch

from nograd.runtime.handler import ModelHandler
from nograd.runtime.loader import (
    LoadError,
    build_artifact_handler,
    import_model_module,
    inside,
    load_weights,
    locate,
)
from nograd.runtime.runners import Handler
from nograd.schema.config import PYTHON_FORMAT, ModelConfig


class _HandlerFactory(Protocol):
    def __call__(
        self, model_dir: Path, config: ModelConfig, device: torch.device
    ) -> ModelHandler: ...


def build(repository: Path, model_dir: Path, config: ModelConfig, device: torch.device) -> Handler:
    """Build the model, load its weights, move it to its device (fp32), set eval mode; or, for
    an artifact format, open the artifact with the handler its code supplies."""
    if config.format != PYTHON_FORMAT:
        return build_artifact_handler(repository, model_dir, config, device)
    code = import_model_module(repository, model_dir, config)
    factory = getattr(code, "build_handler", None)
    if factory is not None:
        handler = cast(_HandlerFactory, factory)(model_dir, config, device)
    else:
        build = getattr(code, "build", None)
        if build is None:
            raise LoadError(f"{model_dir / config.module}: defines neither build nor build_handler")
        module = build(model_dir)
        if not isinstance(module, torch.nn.Module):
            raise LoadError(f"{model_dir / config.module}: build() returned {type(module)}")
        if config.weights is not None:
            state = load_weights(inside(repository, locate(model_dir, config.weights)), device)
            try:
                module.load_state_dict(state, strict=True)
            except RuntimeError as exc:
                raise LoadError(f"{model_dir / config.weights}: {exc}") from exc
        handler = ModelHandler(module, config, device)
    eager = handler.module
    if eager is None:
        raise LoadError(f"{model_dir / config.module}: build_handler gave a handler with no module")
    eager.to(device)
    # Weights stay fp32 here: ``precision`` is a speed mode (nograd/runtime/speed/) that casts
    # only after comparing its outputs with this fp32 eager model.
    eager.eval()
    for parameter in eager.parameters():
        parameter.requires_grad_(False)
    return handler
