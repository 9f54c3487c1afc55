"""A tiny python model folder for the engine tests: a two-layer classifier, weights from a seed."""

from __future__ import annotations

from pathlib import Path

import torch

from nograd.runtime.handler import ModelHandler
from nograd.runtime.loader import build_handler
from nograd.schema.config import ModelConfig, load_config

MODEL_CODE = """
import torch


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.hidden = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 4)
        for parameter in self.parameters():
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3

    def forward(self, x):
        scores = self.out(torch.relu(self.hidden(x)))
        return {"scores": scores, "label": scores.argmax(dim=1, keepdim=True)}


def build(model_dir):
    return Tiny()
"""

CONFIG = """
name = "tiny"
weights = ""
max_batch_size = 32
{extra}

[[inputs]]
name = "x"
datatype = "FP32"
shape = [16]

[[outputs]]
name = "scores"
datatype = "FP32"
shape = [4]

[[outputs]]
name = "label"
datatype = "INT64"
shape = [1]
"""


def tiny_folder(root: Path, extra: str = "") -> Path:
    folder = root / "tiny"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_CODE)
    (folder / "config.toml").write_text(CONFIG.format(extra=extra))
    return folder


def tiny_handler(root: Path, extra: str = "") -> ModelHandler:
    folder = tiny_folder(root, extra)
    config: ModelConfig = load_config(folder / "config.toml")
    return build_handler(root, folder, config, torch.device("cpu"))
