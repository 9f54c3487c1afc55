"""TorchServe's format as the table's row: a ``.mar`` archive directly in the repository."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nograd.formats.torchserve.reading.archives import SUFFIX
from nograd.schema.config import TORCHSERVE_FORMAT, ModelConfig


@dataclass(frozen=True)
class TorchServeFormat:
    """An archive is a file, unpacked into the archive store before it is read
    (``nograd.formats.torchserve.reading.archives``)."""

    name: str = "torchserve"
    runner: str = "nograd.formats.torchserve.running.runner:build"
    warmup: str | None = None
    refuses_rows_over_batch_limit: bool = False
    shape_refusal_note: str = ""

    def recognises(self, entry: Path) -> bool:
        return entry.is_file() and entry.suffix == SUFFIX

    def reads(self, config: ModelConfig) -> bool:
        return config.format == TORCHSERVE_FORMAT

    def serves(self, config: ModelConfig) -> bool:
        return config.format == TORCHSERVE_FORMAT

    def label(self, config: ModelConfig) -> str:
        return config.format


TORCHSERVE: Final = TorchServeFormat()
