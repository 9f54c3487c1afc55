"""A folder holding ``factor.txt``: its model multiplies its input by that number."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nograd.schema.config import ModelConfig

FACTOR_FILE: Final = "factor.txt"


@dataclass(frozen=True)
class ScaledFormat:
    """Reads the folder's name as the model's, a two-element FP32 input ``x`` and output ``y``."""

    name: str = "scaled"
    runner: str = "tests.unit.formats.scaled.running:build"

    def recognises(self, entry: Path) -> bool:
        return (entry / FACTOR_FILE).is_file()

    def read_config(self, folder: Path) -> ModelConfig:
        tensor = {"datatype": "FP32", "shape": [2]}
        return ModelConfig.model_validate(
            {
                "name": folder.name,
                "backend": self.name,
                "weights": None,
                "device": "cpu",
                "inputs": [{"name": "x", **tensor}],
                "outputs": [{"name": "y", **tensor}],
            }
        )

    def serves(self, config: ModelConfig) -> bool:
        return config.backend == self.name


SCALED: Final = ScaledFormat()
ROW: Final = f"{__name__}:SCALED"
"""The table row that adds this format."""
