"""nograd's own format as the table's row: a folder holding ``config.toml`` or ``config.yaml``."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nograd.formats.nograd.reading import read_folder
from nograd.formats.source import ModelSource, Override
from nograd.schema.config import ModelConfig, find_config


@dataclass(frozen=True)
class NogradFormat:
    """Last in the table: it serves every config no format before it claims, which includes the
    artifacts other formats read into an engine's (Triton's ONNX and PyTorch backends)."""

    name: str = "nograd"
    runner: str = "nograd.formats.nograd.running:build"
    warmup: str | None = None
    refuses_rows_over_batch_limit: bool = False
    shape_refusal_note: str = ""

    def recognises(self, entry: Path) -> bool:
        return entry.is_dir() and find_config(entry) is not None

    def read(
        self, folder: Path, override: Override | None, versions: Collection[str] | None
    ) -> ModelSource:
        return read_folder(folder, override, versions)

    def reads(self, config: ModelConfig) -> bool:
        return True

    def serves(self, config: ModelConfig) -> bool:
        return True

    def label(self, config: ModelConfig) -> str:
        return config.format


NOGRAD: Final = NogradFormat()
