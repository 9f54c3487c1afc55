"""A folder holding ``factor.txt``: its model multiplies its input by that number."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nograd.formats.source import ModelSource, Override, shared_config_source
from nograd.schema.config import ModelConfig

FACTOR_FILE: Final = "factor.txt"


@dataclass(frozen=True)
class ScaledFormat:
    """Reads the folder's name as the model's, a two-element FP32 input ``x`` and output ``y``,
    served by every numbered version folder."""

    name: str = "scaled"
    runner: str = "tests.unit.formats.scaled.running:build"
    warmup: str | None = None
    refuses_rows_over_batch_limit: bool = False
    shape_refusal_note: str = ""

    def recognises(self, entry: Path) -> bool:
        return (entry / FACTOR_FILE).is_file()

    def read(
        self, folder: Path, override: Override | None, versions: Collection[str] | None
    ) -> ModelSource:
        tensor = {"datatype": "FP32", "shape": [2]}
        config = ModelConfig.model_validate(
            {
                "name": folder.name,
                "backend": self.name,
                "weights": None,
                "device": "cpu",
                "inputs": [{"name": "x", **tensor}],
                "outputs": [{"name": "y", **tensor}],
            }
        )
        return shared_config_source(config, folder, override, versions)

    def reads(self, config: ModelConfig) -> bool:
        return config.backend == self.name

    def serves(self, config: ModelConfig) -> bool:
        return config.backend == self.name

    def label(self, config: ModelConfig) -> str:
        return self.name


SCALED: Final = ScaledFormat()
ROW: Final = f"{__name__}:SCALED"
"""The table row that adds this format."""
