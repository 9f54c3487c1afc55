"""What the format table's Triton row names: a Python-backend model built and initialised."""

from __future__ import annotations

from pathlib import Path

import torch

from nograd.formats.triton.running.python_backend.handler import (
    PythonBackendHandler,
    auto_completed,
    model_class,
    register_utils,
)
from nograd.runtime.loader import LoadError, import_model_module, locate
from nograd.runtime.runners import RequestRunner
from nograd.schema.config import ModelConfig


def build(
    repository: Path, model_dir: Path, config: ModelConfig, device: torch.device
) -> RequestRunner:
    """A Triton Python-backend model: its ``model.py`` imported under this version's own name
    (with nograd's ``triton_python_backend_utils``), its config auto-completed by the model when
    it says how, then ``initialize``d."""
    register_utils()
    code = import_model_module(repository, model_dir, config)
    where = str(locate(model_dir, config.module))
    try:
        cls = model_class(code, where)
        config = auto_completed(cls, config)
        handler = PythonBackendHandler(cls(), config, device, str(model_dir.parent))
        handler.initialize()
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{where}: {type(exc).__name__}: {exc}") from exc
    return handler
