"""What serves a ``scaled`` model: a torch module multiplying by the folder's factor."""

from __future__ import annotations

from pathlib import Path

import torch

from nograd.runtime.handler import ModelHandler
from nograd.schema.config import ModelConfig
from tests.unit.formats.scaled.format import FACTOR_FILE


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def build(
    repository: Path, model_dir: Path, config: ModelConfig, device: torch.device
) -> ModelHandler:
    del repository
    factor = float((model_dir.parent / FACTOR_FILE).read_text())
    return ModelHandler(Scale(factor).to(device), config, device)
