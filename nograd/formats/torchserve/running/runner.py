"""What the format table's TorchServe row names: an unpacked archive's handler, initialised."""

from __future__ import annotations

from pathlib import Path

import torch

from nograd.formats.torchserve.running.handler import ArchiveLoadError, build_archive_handler
from nograd.runtime.loader import LoadError
from nograd.runtime.runners import RequestRunner
from nograd.schema.config import ModelConfig


def build(
    repository: Path, model_dir: Path, config: ModelConfig, device: torch.device
) -> RequestRunner:
    """The archive's handler as TorchServe runs it; an archive that cannot load is a
    ``LoadError`` naming why."""
    try:
        return build_archive_handler(model_dir, config, device, repository)
    except ArchiveLoadError as exc:
        raise LoadError(str(exc)) from exc
